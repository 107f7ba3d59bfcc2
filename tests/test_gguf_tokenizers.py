"""Tokenizers rebuilt from GGUF metadata give llama.cpp's ids, and a file's end-of-turn
tokens end a generation.

The ground truth is llama.cpp's own: its ``models/ggml-vocab-*.gguf`` vocabularies with
the strings of their ``.inp`` files and the ids llama.cpp gives each (``.out``, written
by its test-tokenizer-0 with no BOS and no special-token parsing). Every vocabulary of
a tokenizer that a family updraft serves is checked, and StarCoder's, whose split
patterns are SmolLM's. Not checked: ``bert-bge`` (WordPiece) and ``nomic-bert-moe``
(Unigram), encoders' tokenizers; ``command-r``, ``falcon``, ``mpt`` and ``refact``,
tokenizers of families updraft does not serve (the last three do pass); ``aquila``,
``baichuan`` and ``gpt-neox`` come with no cases.

Beyond those cases, generated text is compared with transformers' own GGUF tokenizer
(``AutoTokenizer.from_pretrained(..., gguf_file=...)``) on the vocabularies whose
pre-tokenizer it rebuilds as llama.cpp does. Tekken (Mistral Nemo's), which has no
llama.cpp vocabulary, splits text as Mistral's own tokenizer file's pattern does.
OpenAI's o200k ("gpt-4o", gpt-oss's), which has none either, gives the ids tiktoken
gives with its own o200k pattern on a small vocabulary.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tests.helpers import greedy
from tests.llama_cpp_tree import llama_cpp_tree, vocab_cases, vocab_files
from updraft.checkpoints import gguf
from updraft.checkpoints.gguf_vocab import NotRebuilt, build, rebuild
from updraft.checkpoints.gguf_vocab.stops import stop_token_ids

SERVED = [
    "llama-spm",
    "phi-3",
    "gemma-4",
    "gpt-2",
    "llama-bpe",
    "qwen2",
    "qwen35",
    "deepseek-llm",
    "deepseek-coder",
    "starcoder",
]
TOKENS, MERGES = "tokenizer.ggml.tokens", "tokenizer.ggml.merges"


@functools.cache
def vocab_path(name: str) -> Path:
    files = vocab_files(llama_cpp_tree())
    if name not in files:
        pytest.skip(f"llama.cpp's tree has no ggml-vocab-{name}.gguf with cases")
    return files[name]


@functools.cache
def vocab_fields(name: str) -> dict:
    """A vocabulary file's metadata. transformers' reader walks the string arrays in a
    few seconds where the ``gguf`` package's takes half a minute."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    metadata, _ = read_gguf_metadata(str(vocab_path(name)), (TOKENS, MERGES))
    return metadata


@functools.cache
def rebuilt(name: str) -> Tokenizer:
    tokenizer = build(vocab_fields(name))
    # test-tokenizer-0 does not parse control tokens in the text (user-defined ones it does)
    tokenizer.encode_special_tokens = True
    return tokenizer


@pytest.mark.parametrize("name", SERVED)
def test_the_ids_of_llama_cpp_s_cases_and_their_decoding(name):
    tokenizer = rebuilt(name)
    cases = vocab_cases(vocab_path(name))
    assert len(cases) > 40
    for text, ids in cases:
        assert tokenizer.encode(text, add_special_tokens=False).ids == ids, repr(text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text, repr(text)


def test_a_bos_is_added_where_llama_cpp_adds_one():
    for name, bos in [("llama-spm", 1), ("phi-3", 1), ("gemma-4", 2), ("llama-bpe", 128000)]:
        assert rebuilt(name).encode("Hi there").ids[0] == bos, name
    qwen = rebuilt("qwen2")
    assert qwen.encode("Hi there").ids == qwen.encode("Hi there", add_special_tokens=False).ids


# -- generated text, against transformers' GGUF tokenizer ----------------------------------

FRAGMENTS = [
    " ", "  ", "    ", "\t", "\n", "\n\n", "\r\n", " \n ", "   \t\n",
    "Hello", "world", "It's", "DON'T", "we'll", "naïve", "Ünïcödé",
    "日本語", "中文字符", "한국어", "ひらがな", "カタカナ",
    "🙂", "👩‍💻", "🦙", "🏳️‍🌈",
    "def f(x):\n    return x**2", "if (a<b) { i += 1; }", "#include <stdio.h>", "x = [1, 2, 3]",
    "\u0301", "\u0308", "e\u0301", "\u0915\u094d\u0937",
    "1234567", "3.14", "0x1F", "$$", "...", "--", "'", "\"",
]  # fmt: skip
texts = st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=12).map("".join)
# transformers rebuilds these vocabularies' pre-tokenizers as llama.cpp does (it keeps
# GPT-2's split for DeepSeek's, and no file of Gemma 3 or of Tekken's, DeepSeek V3's or
# SmolLM's pre-tokenizers is at hand).
LIKE_TRANSFORMERS = ["llama-spm", "phi-3", "llama-bpe", "qwen35"]
# Before a text that starts with a space, llama.cpp still writes the "▁" prefix (its
# case " Hello" is "▁" "▁Hello"); transformers' Llama tokenizer does not ("▁Hello").
# Such texts are compared with a letter in front.
PREFIX_SPACE_DIFFERS = {"llama-spm"}


@functools.cache
def transformers_tokenizer(name: str) -> Tokenizer:
    """What ``AutoTokenizer.from_pretrained(..., gguf_file=...)`` builds for the file,
    from the metadata already read (its own loading reads the file again, and the
    model's config with it, ten times slower)."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

    fields = vocab_fields(name)
    renames = mapping.GGUF_TOKENIZER_MAPPING["tokenizer"].items()
    found = {
        new: fields[f"tokenizer.{old}"] for old, new in renames if f"tokenizer.{old}" in fields
    }
    tokenizer, _ = mapping.convert_gguf_tokenizer(fields["general.architecture"], found)
    return tokenizer


@pytest.mark.parametrize("name", LIKE_TRANSFORMERS)
def test_generated_text_gets_transformers_ids_and_decodes_back(name):
    ours, theirs = rebuilt(name), transformers_tokenizer(name)

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(texts)
    def same_ids(text):
        if name in PREFIX_SPACE_DIFFERS and text.startswith(" "):
            text = "x" + text
        want = theirs.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False).ids == want
        assert ours.decode(want, skip_special_tokens=False) == text

    same_ids()


def test_tekken_splits_text_as_mistral_s_own_tokenizer_file_says():
    """Tekken has no llama.cpp test vocabulary: its pieces (the bytes of each, as the
    byte-level model sees them) are those Mistral's own ``tekken_240718.json`` pattern
    gives (the mistral-common wheel's file, applied as tiktoken applies it: every match
    in turn)."""
    import regex
    from tokenizers import decoders

    from tests.llama_cpp_tree import tekken_file
    from updraft.checkpoints.gguf_vocab.pre_tokenizers import byte_level

    pattern = regex.compile(json.loads(tekken_file().read_text())["config"]["pattern"])
    ours, as_text = byte_level("tekken"), decoders.ByteLevel()

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(texts)
    def same_pieces(text):
        pieces = [as_text.decode([piece]) for piece, _ in ours.pre_tokenize_str(text)]
        assert pieces == pattern.findall(text)

    same_pieces()


# -- OpenAI's o200k ("gpt-4o", gpt-oss's), against tiktoken --------------------------------

# Strings where o200k's split differs from others': contractions after any case, words
# cut where lower case turns upper, digits in threes, marks inside words, "/" after
# punctuation and newlines, Unicode blanks.
O200K_CASES = [
    "I'LL go", "We'Re here", "they'VE", "HelloWorld XMLHttpRequest", "1234567",
    "日本語のテキスト", "naïve café e\u0301", "ÉCOLE", "a\n\n\n  b", "   ", "/\n/", "!!!??",
    "🙂👩‍💻", "path/to/file\n", "x\u0085y\u00a0z\u2028", "\x1c\x1d\x1e\x1f a",
]  # fmt: skip
HARMONY_TOKENS = [
    "<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>",
    "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
]  # fmt: skip


@pytest.fixture(scope="module")
def o200k(tmp_path_factory):
    """A small byte-level BPE vocabulary with harmony's control tokens after it, as
    tiktoken's Encoding with its own o200k pattern (``o200k_base``'s, read without its
    vocabulary download) and as GGUF metadata naming the "gpt-4o" pre-tokenizer. The
    vocabulary is trained with that pattern on the strings above, so that their pieces
    are tokens whole and a split made otherwise gives other ids; tiktoken reads it from
    GPT-2's files, checking that its ranks follow the merges."""
    tiktoken = pytest.importorskip("tiktoken", reason="tiktoken (a dev dependency) is missing")
    from unittest import mock

    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext import openai_public
    from tokenizers import Regex, models, pre_tokenizers, trainers

    with mock.patch.object(openai_public, "load_tiktoken_bpe", return_value={}):
        pattern = openai_public.o200k_base()["pat_str"]
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=1000, initial_alphabet=alphabet, show_progress=False)
    trained.train_from_iterator(O200K_CASES + FRAGMENTS, trainer)
    model = json.loads(trained.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [" ".join(merge) for merge in model["merges"]]
    folder = tmp_path_factory.mktemp("o200k")
    (folder / "vocab.bpe").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (folder / "encoder.json").write_text(json.dumps(model["vocab"]))
    with mock.patch.dict("os.environ", {"TIKTOKEN_CACHE_DIR": ""}):  # no cache left behind
        ranks = data_gym_to_mergeable_bpe_ranks(
            str(folder / "vocab.bpe"), str(folder / "encoder.json"), clobber_one_byte_tokens=True
        )
    specials = {text: len(tokens) + i for i, text in enumerate(HARMONY_TOKENS)}
    encoding = tiktoken.Encoding(
        "o200k-small", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
    )
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-4o",
        TOKENS: tokens + HARMONY_TOKENS,
        MERGES: merges,
        "tokenizer.ggml.token_type": [1] * len(tokens) + [3] * len(HARMONY_TOKENS),
        "tokenizer.ggml.bos_token_id": specials["<|startoftext|>"],
        "tokenizer.ggml.eos_token_id": specials["<|return|>"],
    }
    return encoding, fields


def test_gpt_4o_files_get_tiktoken_s_o200k_ids(o200k):
    encoding, fields = o200k
    ours = build(fields)
    ours.encode_special_tokens = True  # as tiktoken's encode_ordinary: control tokens as text
    for text in O200K_CASES:
        want = encoding.encode_ordinary(text)
        assert ours.encode(text, add_special_tokens=False).ids == want, repr(text)
        assert ours.decode(want) == text
    # the strings tell o200k's split from its nearest kin's
    for kin in ("gpt-2", "llama-bpe", "tekken"):
        other = build({**fields, "tokenizer.ggml.pre": kin})
        assert any(
            other.encode(text, add_special_tokens=False).ids != encoding.encode_ordinary(text)
            for text in O200K_CASES
        ), kin

    cases = st.lists(st.sampled_from(FRAGMENTS + O200K_CASES), min_size=1, max_size=12)

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(cases.map("".join), st.text(max_size=40)))
    def same_ids(text):
        assert ours.encode(text, add_special_tokens=False).ids == encoding.encode_ordinary(text)

    same_ids()


def test_a_gpt_oss_file_chats_in_harmony_and_stops_where_llama_cpp_does(o200k, demo_file, tmp_path):
    """A file with gpt-oss's tokenizer fields and chat template: its prompt text gets
    tiktoken's ids with harmony's tokens whole and no BOS, and generation stops at
    ``<|return|>`` and ``<|call|>``, not at the ``<|end|>`` that ends every message."""
    from updraft.chat_template import ChatTemplate
    from updraft.serve.parsers.harmony import is_harmony
    from updraft.tokenizer import Tokenizer as UpdraftTokenizer

    encoding, fields = o200k
    template = (llama_cpp_tree() / "models/templates/openai-gpt-oss-120b.jinja").read_text()
    changes = {**fields, "tokenizer.chat_template": template}
    directory = Path(
        gguf.checkpoint_dir(str(with_metadata(demo_file, tmp_path / "oss.gguf", changes)))
    )
    chat = ChatTemplate.from_dir(directory)
    assert is_harmony(chat.source)
    prompt = chat.render([{"role": "user", "content": "I'LL count: 1234567"}])
    ids = UpdraftTokenizer.from_dir(directory).backend.encode(prompt).ids
    assert ids == encoding.encode(prompt, allowed_special="all")
    assert encoding.encode_single_token("<|start|>") == ids[0]

    stops = json.loads((directory / "generation_config.json").read_text())["eos_token_id"]
    assert stops[0] == fields["tokenizer.ggml.eos_token_id"]
    names = {encoding.decode_single_token_bytes(index).decode() for index in stops}
    assert names == {"<|return|>", "<|call|>", "<|endoftext|>"}


# -- pre-tokenizers refused by name --------------------------------------------------------


def test_what_cannot_be_rebuilt_is_refused_naming_it():
    fields = {**vocab_fields("gpt-2"), "tokenizer.ggml.pre": "no-such-splitter"}
    with pytest.raises(NotRebuilt, match="'no-such-splitter'"):
        build(fields)
    text, why = rebuild(fields)
    assert text is None and "no-such-splitter" in why
    with pytest.raises(NotRebuilt, match="'bert'"):
        build({**fields, "tokenizer.ggml.model": "bert"})
    count = len(fields[TOKENS])
    short = {
        **vocab_fields("gpt-2"),
        "tokenizer.ggml.token_type": fields["tokenizer.ggml.token_type"][:10],
    }
    with pytest.raises(ValueError, match=f"token_type has 10 entries for {count} tokens"):
        build(short)


# -- stop ids ------------------------------------------------------------------------------


def test_the_end_of_turn_tokens_llama_cpp_stops_at_are_stop_ids():
    def ids(name, *texts):
        tokens = vocab_fields(name)[TOKENS]
        return [tokens.index(text) for text in texts]

    llama3 = stop_token_ids(vocab_fields("llama-bpe"))
    assert llama3[0] == vocab_fields("llama-bpe")["tokenizer.ggml.eos_token_id"]
    assert set(ids("llama-bpe", "<|eot_id|>", "<|end_of_text|>")) <= set(llama3)
    assert set(ids("phi-3", "<|end|>", "<|endoftext|>")) <= set(
        stop_token_ids(vocab_fields("phi-3"))
    )
    gemma = stop_token_ids(vocab_fields("gemma-4"))
    assert set(ids("gemma-4", "<eos>", "<turn|>")) <= set(gemma)
    assert set(ids("qwen2", "<|im_end|>", "<|endoftext|>")) <= set(
        stop_token_ids(vocab_fields("qwen2"))
    )
    # ids the file names come first, whatever their text
    fields = {**vocab_fields("llama-spm"), "tokenizer.ggml.eot_token_id": 7}
    assert stop_token_ids(fields)[:2] == [2, 7]


@pytest.fixture(scope="module")
def demo_file(tmp_path_factory) -> Path:
    """The demo model (Llama, byte-level BPE) as an F16 GGUF."""
    from benchmarks.peers import make_gguf
    from tests.test_gguf import as_float16
    from updraft.demo import DEMO_MODEL_DIR

    out = tmp_path_factory.mktemp("demo-gguf") / "demo-f16.gguf"
    make_gguf.main(Path(DEMO_MODEL_DIR), out, as_float16)
    return out


def test_a_file_s_end_of_turn_id_goes_into_generation_config_and_stops_generation(
    demo_file, tmp_path
):
    from updraft import LLM

    path = demo_file
    plain = (
        LLM(str(path), enforce_eager=True)
        .generate(["def fib(n):"], greedy(8))[0]
        .outputs[0]
        .token_ids
    )
    eot, eom = plain[3], plain[5]
    ids = {"tokenizer.ggml.eot_token_id": eot, "tokenizer.ggml.eom_token_id": eom}
    marked = with_metadata(path, tmp_path / "eot.gguf", ids)
    directory = Path(gguf.checkpoint_dir(str(marked)))
    stops = json.loads((directory / "generation_config.json").read_text())["eos_token_id"]
    assert {eot, eom} <= set(stops)
    out = (
        LLM(str(marked), enforce_eager=True)
        .generate(["def fib(n):"], greedy(8, ignore_eos=False))[0]
        .outputs[0]
    )
    assert out.token_ids == plain[: plain.index(eot) + 1]
    assert out.finish_reason == "stop"


def test_a_file_whose_tokenizer_is_not_rebuilt_says_why_when_loaded(demo_file, tmp_path, caplog):
    path = demo_file
    odd = with_metadata(path, tmp_path / "odd.gguf", {"tokenizer.ggml.pre": "no-such-splitter"})
    with caplog.at_level(logging.WARNING):
        directory = Path(gguf.checkpoint_dir(str(odd)))
    assert not (directory / "tokenizer.json").exists()
    assert "no-such-splitter" in caplog.text


def with_metadata(path: Path, out: Path, changes: dict) -> Path:
    """``path`` written again by gguf-py's writer, with metadata keys set: integers as
    uint32, strings as strings, lists as arrays of int32 or strings; None drops a key."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(path))
    writer = GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in changes:
            continue
        sub_type = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for key, value in changes.items():
        if isinstance(value, list):
            sub_type = GGUFValueType.STRING if isinstance(value[0], str) else GGUFValueType.INT32
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=sub_type)
        elif value is not None:
            kind = GGUFValueType.STRING if isinstance(value, str) else GGUFValueType.UINT32
            writer.add_key_value(key, value, kind)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
