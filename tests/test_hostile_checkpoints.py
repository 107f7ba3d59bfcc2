"""Hostile checkpoints: each broken GGUF file and config.json is refused in one line that
names the file and the field, or loads and generates, within 10 s and 300 MiB above the
imports, in this process (``tests/bounded.py``).

* The corpus of hand-made corruptions of a good GGUF file (``tests/gguf_corpus.py``),
  each with the line it must give, through ``LLM`` and, for a few, ``updraft generate``
  (exit status 2, the line on stderr, no traceback).
* A config.json claiming 2^31 layers or a hidden size of 2^20 over two layers of 64-wide
  weights, and a safetensors header claiming bytes past the end of its file.
* A fuzz test: hypothesis overwrites the good file's header numbers (counts, string
  lengths, value and tensor types, dimensions, offsets), its sizing metadata and where
  it ends, and the tiny checkpoint's config.json sizes, with values no writer would
  write; every case loads and generates, or raises ``ValueError`` in one line.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from gguf import GGUFValueType
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from benchmarks.peers import make_gguf
from tests.bounded import bounded
from tests.checkpoints import build_checkpoint
from tests.conftest import add_byte_tokenizer
from tests.gguf_bytes import GGUFParts, patched
from tests.gguf_corpus import CASES, LOADS
from updraft import LLM, SamplingParams
from updraft.cli import main

SECONDS, MIB = 10, 300
ARGS = {"num_kv_blocks": 8, "enforce_eager": True}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    checkpoint = add_byte_tokenizer(build_checkpoint("llama-plain", root / "hf"))
    make_gguf.main(checkpoint, root / "good.gguf")
    LLM(str(root / "good.gguf"), **ARGS)  # imports and kernels warmed
    return root / "good.gguf"


@pytest.fixture(scope="module")
def parts(good):
    return GGUFParts.read(good)


def outcome(model: str) -> str | None:
    """None when ``model`` loads and generates; else its error's line. Anything but a
    ``ValueError`` (or a bound run out) fails the test."""
    with bounded(SECONDS, MIB) as spent:
        try:
            llm = LLM(model, **ARGS)
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
            line = None
        except ValueError as error:
            line = str(error)
    assert spent.peak_mib < MIB, spent
    if line is not None:
        assert "\n" not in line, line
    return line


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_corrupt_file_gives_its_line(good, parts, tmp_path, case):
    make, said = CASES[case]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(make(parts))
    line = outcome(str(bad))
    if said is LOADS:
        assert line is None
    else:
        assert line is not None and re.search(said, line), line
        assert bad.name in line, line


@pytest.mark.parametrize("case", ["head_count 0", "block_count 2^31", "garbage merges"])
def test_updraft_generate_exits_2_with_the_line(good, parts, tmp_path, case, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(CASES[case][0](parts))
    with bounded(SECONDS, MIB):
        status = main(["generate", "--model", str(bad), "--prompt", "hi", "--max-tokens", "2"])
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and bad.name in err, err


@pytest.fixture(scope="module")
def checkpoint(good):
    return good.parent / "hf"


def _with_config(source, target, **changes):
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    config = {key: value for key, value in config.items() if value != DROPPED}
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"num_hidden_layers": 2**31}, r"num_hidden_layers is 2147483648, but the weights hold 2"),
        ({"hidden_size": 2**20}, r"hidden_size is 1048576, wider than any tensor of the weights"),
        ({"intermediate_size": 2**40}, r"intermediate_size is 1099511627776, wider than any"),
        ({"num_attention_heads": 0}, r"num_attention_heads must be a positive int, got 0"),
        ({"head_dim": "64"}, r"head_dim must be a positive int, got '64'"),
        (
            {"num_key_value_heads": 4},
            r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' of shape "
            r"\(32, 64\) cannot fill model\.layers\.0\.self_attn\.qkv_proj\.weight, which takes "
            r"\(64, 64\)",
        ),
        ({"max_position_embeddings": 2**31}, LOADS),  # the tables follow the KV cache
    ],
)
def test_a_config_is_checked_against_its_weights(checkpoint, tmp_path, changes, said):
    line = outcome(str(_with_config(checkpoint, tmp_path / "hf", **changes)))
    if said is LOADS:
        assert line is None
    else:
        assert line is not None and re.search(said, line), line


def test_a_safetensors_header_past_its_file_is_refused(checkpoint, tmp_path):
    model = _with_config(checkpoint, tmp_path / "hf")
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    line = outcome(str(model))
    assert line is not None and "does not lie in the file's" in line, line
    weights.write_bytes((2**40).to_bytes(8, "little") + data[8:])
    line = outcome(str(model))
    assert line is not None and "its header claims 1099511627776 bytes" in line, line


# -- fuzz ----------------------------------------------------------------------------------

INTERESTING = [0, 1, 2, 3, 7, 2**8, 2**16 - 1, 2**31, 2**32, 2**40, 2**63, 2**64 - 1]
SIZING = [key for key, _ in (("llama." + k, 0) for k in ("block_count", "context_length",
          "embedding_length", "feed_forward_length", "attention.head_count",
          "attention.head_count_kv", "attention.key_length", "rope.freq_base",
          "attention.layer_norm_rms_epsilon"))]  # fmt: skip


def _header_numbers(parts: GGUFParts) -> list:
    """Every number the header holds except the 512 of the vocabulary's items, which
    would drown the rest, and three of those."""
    parts.to_bytes()
    numbers = [n for n in parts.numbers if " item " not in n.label]
    numbers += [n for n in parts.numbers if re.search(r" item (0|100|255)\b", n.label)]
    return numbers


def mutations(parts: GGUFParts) -> st.SearchStrategy:
    """One change to the good file, as (what, which, value): a header number
    overwritten, a sizing key's value replaced (by an integer, a float or a string), or
    the file cut short."""
    numbers = st.sampled_from([n.label for n in _header_numbers(parts)])
    values = st.sampled_from(INTERESTING[:-2]) | st.floats() | st.just("8")
    return st.one_of(
        st.tuples(st.just("number"), numbers, st.sampled_from(INTERESTING)),
        st.tuples(st.just("number"), numbers, st.integers(0, 2**64 - 1)),
        st.tuples(st.just("value"), st.sampled_from(SIZING), values),
        st.tuples(st.just("cut"), st.just(""), st.floats(0, 1, exclude_max=True)),
    )


def broken(parts: GGUFParts, how: str, which: str, value) -> bytes:
    if how == "value":
        kind = GGUFValueType.UINT64
        if isinstance(value, str):
            kind = GGUFValueType.STRING
        elif isinstance(value, float):
            kind = GGUFValueType.FLOAT64
        return parts.with_value(which, value, kind).to_bytes()
    data = parts.to_bytes()
    if how == "cut":
        return data[: int(len(data) * value)]
    return patched(data, next(n for n in parts.numbers if n.label == which), value)


def _kind(line: str | None) -> str:
    """What happened, for ``--hypothesis-show-statistics``."""
    return "loads" if line is None else "refused: " + re.sub(r"\d+", "N", line)[-70:]


FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(data=st.data())
def test_fuzzed_gguf_files_load_or_give_one_line(good, parts, tmp_path, data):
    bad = tmp_path / "fuzzed.gguf"
    bad.write_bytes(broken(parts, *data.draw(mutations(parts))))
    line = outcome(str(bad))
    assert line is None or bad.name in line, line
    event(_kind(line))


CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim",
               "max_position_embeddings", "rms_norm_eps", "rope_theta", "sliding_window",
               "tie_word_embeddings", "architectures")  # fmt: skip
DROPPED = "dropped"  # the key taken out of the config


def config_changes() -> st.SearchStrategy:
    """One to three keys of the tiny config.json, each set to a value no checkpoint
    would hold (or taken out)."""
    values = (
        st.sampled_from([-1, *INTERESTING]) | st.integers(-(2**70), 2**70) | st.floats()
        | st.sampled_from(["8", None, [], {}, True, DROPPED])
    )  # fmt: skip
    return st.dictionaries(st.sampled_from(CONFIG_KEYS), values, min_size=1, max_size=3)


@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_fuzzed_configs_load_or_give_one_line(checkpoint, tmp_path_factory, data):
    target = tmp_path_factory.mktemp("fuzzed") / "hf"
    line = outcome(str(_with_config(checkpoint, target, **data.draw(config_changes()))))
    event(_kind(line))
