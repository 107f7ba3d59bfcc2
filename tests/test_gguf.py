"""GGUF files: blocks read where they lie, and a model from a file equal to transformers.

* Each block type's widening equals the ``gguf`` package's numpy dequantization bit for
  bit (K-quant and IQ4 blocks are random bytes with finite half scales: the package
  reads them but cannot write them), and the kernel's product with a block weight
  equals float32's on its dequantization, in each of its AVX-512, AVX2 and plain-C
  builds that the CPU can execute, at one row of x (each build's own path) and more.
* A Llama GGUF written by ``benchmarks/peers/make_gguf.py`` (which permutes q/k rows as
  llama.cpp's converter does) gives the safetensors checkpoint's logits; a loader that
  skips the un-permute does not.
* Files whose linears and embedding are in each block type (Q4_K_M-, Q3_K_M-, Q2_K-
  and IQ4_XS-like mixes included) give the logits transformers computes on the float32
  weights their blocks stand for; a file split in parts loads like one; the loaded
  weights take about the file's tensor bytes; an architecture, a tensor type or a RoPE
  table that cannot be read is refused by name.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from safetensors.torch import save_file

from benchmarks.peers import make_gguf
from tests.checkpoints import build_checkpoint
from tests.helpers import greedy, token_ids
from tests.probes import logits_of, probed, records
from tests.test_reference_models import PROMPTS
from updraft import LLM
from updraft.kernels.gguf_ops import BLOCK_TYPES, BLOCKS
from updraft.models import gguf_loader
from updraft.models.packed_linear import PackedLinear

# Where a block holds its half scales: (byte offset, how many halves).
SCALE_BYTES = {
    "Q4_0": (0, 1),
    "Q5_0": (0, 1),
    "Q8_0": (0, 1),
    "Q4_1": (0, 2),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q6_K": (208, 1),
    "Q2_K": (80, 2),
    "Q3_K": (108, 1),
    "Q5_K": (0, 2),
    "IQ4_NL": (0, 1),
    "IQ4_XS": (0, 1),
}
# The types the gguf package can write; the others' blocks are random bytes here.
WRITTEN = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def random_blocks(
    kind: str, rows: int, k: int, rng: np.random.Generator, scale: float = 0.02
) -> np.ndarray:
    """Random bytes in ``kind``'s blocks [rows, row_bytes], with finite half scales of
    about ``scale``."""
    values, size = BLOCKS[BLOCK_TYPES[kind]]
    blocks = rng.integers(0, 256, size=(rows, k // values, size), dtype=np.uint8)
    if kind == "MXFP4":  # a power-of-two scale byte, 2^(e - 127), around ``scale``
        exponent = 127 + round(np.log2(scale))
        blocks[..., 0] = rng.integers(exponent - 4, exponent + 3, size=(rows, k // values))
        return blocks.reshape(rows, -1)
    start, count = SCALE_BYTES[kind]
    scales = rng.normal(0, scale, size=(rows, k // values, count)).astype(np.float16)
    blocks[..., start : start + 2 * count] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(BLOCK_TYPES))
@pytest.mark.usefixtures("all_cores")
def test_blocks_widen_to_the_gguf_package_s_values_bit_for_bit(kind):
    rng = np.random.default_rng(0)
    values = BLOCKS[BLOCK_TYPES[kind]][0]
    blocks = random_blocks(kind, 7, 3 * values, rng)
    want = quants.dequantize(blocks, GGMLQuantizationType[kind])
    got = torch.ops.updraft.gguf_dequantize(torch.from_numpy(blocks), BLOCK_TYPES[kind], 3 * values)
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))
    part = gguf_loader.Part(torch.from_numpy(blocks), BLOCK_TYPES[kind])
    linear = gguf_loader.GGUFLinear(3 * values, [part], None)
    # the kernel alone; a pass of it per 8 rows; a chunk of weight rows widened
    weight = torch.from_numpy(want).double()
    generator = torch.Generator().manual_seed(0)
    for rows in (1, 3, 8, 9, 40, 100):
        x = torch.randn(rows, 3 * values, generator=generator)
        expected = x.double() @ weight.T
        # float32's rounding, on the scale of the terms summed (random blocks make large
        # weights whose products cancel)
        bound = 1e-5 * (x.double().abs() @ weight.abs().T) + 1e-6
        assert ((linear(x).double() - expected).abs() <= bound).all(), rows


# The kernel's builds: this CPU's own (AVX-512 here), AVX2's 8 lanes (haswell) and no
# vector extension at all (x86-64: each block widened into a buffer). Each has a path of
# its own for one row of x (a decode step), which spreads its sums over several
# accumulators: AVX-512's take turns by block (four), AVX2's by offset in the block
# (eight), so x is five blocks long and the K-quants' blocks reach every one of them.
MARCHES = ("native", "haswell", "x86-64")


def runs_here(march: str) -> bool:
    """Whether this CPU executes code built for ``march``."""
    from tests.test_weight_formats import cpu_flags

    return march != "haswell" or {"avx2", "fma", "f16c"} <= cpu_flags()


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("kind", sorted(BLOCK_TYPES))
@pytest.mark.usefixtures("all_cores")
def test_every_build_the_cpu_runs_multiplies_by_the_dequantized_weight(kind, march):
    """Each build this CPU can execute, not only its widest, gives float64's product
    with gguf-py's dequantization of the blocks, for one row of x and for several (up
    to the kernel's eight at once)."""
    from updraft.kernels.gguf_ops import gguf_linear

    if not runs_here(march):
        pytest.skip(f"this CPU cannot execute code built for -march={march}")
    values = BLOCKS[BLOCK_TYPES[kind]][0]
    k = 5 * values
    blocks = torch.from_numpy(random_blocks(kind, 20, k, np.random.default_rng(3)))
    weight = torch.from_numpy(quants.dequantize(blocks.numpy(), GGMLQuantizationType[kind]))
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(3))
    for rows in (x[:1], x[:3], x):
        got = gguf_linear(rows, blocks, None, BLOCK_TYPES[kind], k, march=march)
        expected = rows.double() @ weight.double().T
        # float32's rounding, on the scale of the terms summed
        bound = 2e-5 * (rows.double().abs() @ weight.double().abs().T) + 1e-6
        assert ((got.double() - expected).abs() <= bound).all(), len(rows)


# -- whole files ---------------------------------------------------------------------------


def plain(kind: str, directory, **shape):
    """A tiny float32 checkpoint without RoPE scaling (make_gguf writes none)."""
    return build_checkpoint(f"{kind}-plain", directory, **shape)


def run(model, **args):
    """Each prompt's greedy tokens and logits (with the exact ``--activations float32``
    unless ``args`` ask otherwise: the references are float checkpoints)."""
    args = {"activations": "float32", **args}
    llm = probed(str(model), block_size=4, num_kv_blocks=64, **args)
    outputs = llm.generate(PROMPTS, greedy(8))
    seen = records(llm)
    return token_ids(outputs), [logits_of(seen, output) for output in outputs], llm


def assert_same(ours, reference, atol=1e-4):
    assert ours[0] == reference[0]
    for mine, theirs in zip(ours[1], reference[1], strict=True):
        torch.testing.assert_close(mine, theirs, atol=atol, rtol=atol)


@pytest.fixture(scope="module")
def llama_f32(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-llama")
    checkpoint = plain("llama", root / "hf")
    make_gguf.main(checkpoint, root / "model.gguf")
    return checkpoint, root / "model.gguf"


def test_a_llama_gguf_gives_the_safetensors_logits_once_q_and_k_are_unpermuted(
    llama_f32, monkeypatch
):
    checkpoint, path = llama_f32
    reference = run(checkpoint)
    assert_same(run(path), reference)
    monkeypatch.setattr(gguf_loader, "unpermute", lambda rows, heads: rows)
    with pytest.raises(AssertionError):
        assert_same(run(path), reference)


def convert_to(types: dict[str, str], rng: np.random.Generator, reference: dict):
    """A make_gguf converter writing each tensor in the first type whose pattern its
    GGUF name contains (float32 otherwise), and recording in ``reference`` the float32
    values each F16 or block tensor stands for (rows as the file orders them)."""

    def convert(name: str, array: np.ndarray):
        kind = next((t for pattern, t in types.items() if pattern in name), "F32")
        if kind == "F32" or array.ndim != 2:
            return array.astype(np.float32), None
        if kind == "F16":
            reference[name] = array.astype(np.float16).astype(np.float32)
            return array.astype(np.float16), None
        qtype = GGMLQuantizationType[kind]
        if kind not in WRITTEN:  # the package cannot write K-quants or IQ4: random blocks
            # a sub-block scale of up to 63 (Q4_K, Q5_K), 127 (Q6_K) or 32 (Q3_K, IQ4_XS)
            # times codes of up to 15, 31, 32, 4 or 127: half scales small enough that
            # weights stay near the model's own
            blocks = random_blocks(kind, array.shape[0], array.shape[1], rng, scale=2e-4)
        else:
            blocks = quants.quantize(array, qtype)
        reference[name] = quants.dequantize(blocks, qtype)
        return blocks, qtype

    return convert


MIXES = {
    "Q8_0": {"": "Q8_0"},
    "Q4_0-Q4_1": {"attn": "Q4_0", "ffn": "Q4_1", "token_embd": "Q4_0", "output.": "Q8_0"},
    "Q5_0-Q5_1-F16": {"attn_q": "Q5_0", "attn_k": "Q5_1", "ffn": "Q5_0", "attn_output": "F16"},
    # Q4_K_M's pattern: v and down in Q6_K, the rest in Q4_K, the output in Q6_K
    "Q4_K_M": {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output.": "Q6_K", "blk": "Q4_K"},
    # after Q3_K_M's and Q2_K's patterns, in one file: v and down in Q5_K, q and k in
    # Q2_K, the output in Q6_K, the rest (the embedding included) in Q3_K
    "Q3_K_M-Q2_K": {
        "attn_v": "Q5_K",
        "ffn_down": "Q5_K",
        "attn_q": "Q2_K",
        "attn_k": "Q2_K",
        "output.": "Q6_K",
        "": "Q3_K",
    },
    # IQ4_XS, with IQ4_NL where llama.cpp falls back to it (and for the embedding)
    "IQ4_XS-IQ4_NL": {"ffn_down": "IQ4_NL", "token_embd": "IQ4_NL", "": "IQ4_XS"},
}


# The first mixes in each family; the later ones once each, as what a block stands for
# does not depend on the family (Llama's file has its Q2_K q/k rows permuted, too).
FILES = [
    *(
        (kind, mix)
        for mix in ("Q8_0", "Q4_0-Q4_1", "Q5_0-Q5_1-F16", "Q4_K_M")
        for kind in ("llama", "qwen2", "qwen3")
    ),
    ("llama", "Q3_K_M-Q2_K"),
    ("qwen3", "IQ4_XS-IQ4_NL"),
]


@pytest.mark.parametrize(("kind", "mix"), FILES)
def test_a_file_in_blocks_gives_transformers_logits_on_what_its_blocks_stand_for(
    tmp_path, kind, mix
):
    # K-quants and IQ4_XS take rows of 256 values: a wider model for them.
    wide = any(BLOCKS[BLOCK_TYPES[t]][0] == 256 for t in MIXES[mix].values() if t != "F16")
    shape = {"hidden_size": 256, "intermediate_size": 512} if wide else {}
    checkpoint = plain(kind, tmp_path / "hf", **shape)
    stands_for: dict[str, np.ndarray] = {}
    path = tmp_path / "model.gguf"
    make_gguf.main(checkpoint, path, convert_to(MIXES[mix], np.random.default_rng(1), stands_for))
    reference = _reference(checkpoint, tmp_path / "reference", stands_for, kind)
    ours = run(path)
    assert_same(ours, run(reference))
    llm = ours[2]
    modules = list(llm.engine._runner.model.modules())  # noqa: SLF001
    # Q8_0 and Q4_0 go into int8/int4 panels, the other block types stay in blocks
    in_blocks = [m for m in modules if isinstance(m, gguf_loader.GGUFLinear)]
    in_panels = [m for m in modules if isinstance(m, PackedLinear) and m.format.quantized]
    assert in_blocks or in_panels
    assert bool(in_blocks) == any(t not in ("Q8_0", "Q4_0", "F16") for t in MIXES[mix].values())


def _reference(checkpoint, directory, stands_for: dict[str, np.ndarray], kind: str):
    """``checkpoint`` with each block tensor's weight replaced by what its blocks stand
    for (q/k rows put back in transformers' order for Llama)."""
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(checkpoint, directory)
    tensors = load_file(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    for name, values in stands_for.items():
        hf = gguf_loader.hf_name(name)
        if kind == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in hf else "num_key_value_heads"]
            values = gguf_loader.unpermute(values, heads)
        tensors[hf] = torch.from_numpy(np.ascontiguousarray(values))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def test_a_split_file_loads_like_one(llama_f32, tmp_path):
    checkpoint, whole = llama_f32
    make_gguf.main(checkpoint, tmp_path / "model.gguf", split_max_tensors=5)
    parts = sorted(tmp_path.glob("model-*-of-*.gguf"))
    assert len(parts) > 2
    assert_same(run(parts[1]), run(whole))


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_loaded_weights_take_about_the_file_s_tensor_bytes_and_graphs_hold_no_widened_copy(
    tmp_path, activations
):
    from gguf import GGUFReader

    checkpoint = plain("llama", tmp_path / "hf", hidden_size=256, intermediate_size=512)
    path = tmp_path / "model.gguf"
    make_gguf.main(checkpoint, path, convert_to(MIXES["Q4_K_M"], np.random.default_rng(2), {}))
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)
    # A 128-token mixed bucket: its prefill widens the blocks a chunk of rows at a time
    # (with int8 activations, from the rows regrouped eight at a time)
    llm = LLM(str(path), num_kv_blocks=8, capture_tokens=(128,), activations=activations)
    runner = llm.engine._runner  # noqa: SLF001
    model = runner.model
    grouped = [
        m for m in model.modules() if isinstance(m, gguf_loader.GGUFLinear) and any(m.grouped)
    ]
    assert bool(grouped) == (activations == "int8")
    held = {  # each tensor once (a tied head shares its blocks), the RoPE tables left out
        tensor.data_ptr(): tensor.numel() * tensor.element_size()
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if "rotary" not in name
    }
    loaded = sum(held.values())
    assert abs(loaded - file_bytes) <= 0.1 * file_bytes, (loaded, file_bytes)
    # and no graph keeps the widened weights as constants it folded, beside the blocks
    # (views of them it folded cost nothing): each would be a float32 copy of the model,
    # several times the file
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    widened = 4 * sum(
        m.out_features * m.in_features
        for m in model.modules()
        if isinstance(m, gguf_loader.GGUFLinear)
    )
    folded = sum(
        tensor.numel() * tensor.element_size()
        for captured in runner.captured.graphs.values()
        for tensor in captured.graph.backend.folded
        if tensor.untyped_storage().data_ptr() not in weights
    )
    assert widened > file_bytes and folded < 0.05 * widened, (folded, widened)


def _rewrite(path, out, **change):
    """``path`` written again with metadata or tensors changed."""
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(str(path))
    arch = change.get("arch", reader.fields["general.architecture"].contents())
    writer = GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        key = key.replace(reader.fields["general.architecture"].contents() + ".", arch + ".", 1)
        writer.add_key_value(
            key, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None
        )
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    for name, array in change.get("tensors", {}).items():
        data, qtype = array
        writer.add_tensor(name, data, raw_shape=None, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_what_cannot_be_read_is_refused_by_name(llama_f32, tmp_path):
    _, path = llama_f32
    mamba = _rewrite(path, tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(ValueError, match="architecture 'mamba'"):
        LLM(str(mamba))
    iq2 = np.zeros((4, 66), dtype=np.uint8)  # four rows of 256 values in IQ2_XXS
    odd = _rewrite(
        path, tmp_path / "iq2.gguf", tensors={"extra.weight": (iq2, GGMLQuantizationType.IQ2_XXS)}
    )
    with pytest.raises(ValueError, match="IQ2_XXS"):
        LLM(str(odd))
    # one RoPE factor per frequency: a head of 16 dimensions turns 8
    freqs = (np.ones(5, dtype=np.float32), None)
    scaled = _rewrite(path, tmp_path / "freqs.gguf", tensors={"rope_freqs.weight": freqs})
    with pytest.raises(ValueError, match=r"rope_freqs\.weight holds 5 values.*need 8"):
        LLM(str(scaled))


# -- the tokenizer, chat template and EOS from the file's metadata -------------------------

TEXTS = [
    "def main():\n    return 42",
    "Hello, world! It's 2026-12-04; numbers 1234567 and 3.14.",
    "  leading spaces,\ttabs\n\nand blank lines  ",
    "unicode: café, naïve, 日本語, emoji 🙂",
    "<|endoftext|> a special token's text, inline<|endoftext|>",
]
CHAT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{{ eos_token }}"


def as_float16(name: str, array: np.ndarray):
    return (array.astype(np.float16) if array.ndim == 2 else array.astype(np.float32)), None


@pytest.fixture(scope="module")
def demo_gguf(tmp_path_factory):
    """The demo model (Llama, float16, tied, byte-level BPE) with a chat template, and
    its F16 GGUF."""
    import shutil

    from updraft.demo import DEMO_MODEL_DIR

    root = tmp_path_factory.mktemp("gguf-demo")
    checkpoint = root / "hf"
    shutil.copytree(DEMO_MODEL_DIR, checkpoint)
    settings = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (checkpoint / "tokenizer_config.json").write_text(
        json.dumps({**settings, "chat_template": CHAT})
    )
    make_gguf.main(checkpoint, root / "demo-f16.gguf", as_float16)
    return checkpoint, root / "demo-f16.gguf"


def test_the_tokenizer_chat_template_and_eos_come_from_the_file(demo_gguf):
    from updraft.chat_template import ChatTemplate
    from updraft.checkpoints.local import local_checkpoint
    from updraft.model_config import ModelConfig
    from updraft.tokenizer import Tokenizer

    checkpoint, path = demo_gguf
    directory = local_checkpoint(str(path))
    ours, theirs = Tokenizer.from_dir(directory), Tokenizer.from_dir(checkpoint)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(theirs.encode(text), skip_special_tokens=False) == text
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rendered = ChatTemplate.from_dir(directory).render(messages, add_generation_prompt=False)
    assert rendered == ChatTemplate.from_dir(checkpoint).render(
        messages, add_generation_prompt=False
    )
    assert rendered.endswith("<|endoftext|>")
    assert (
        ModelConfig.from_dir(directory).eos_token_ids
        == ModelConfig.from_dir(checkpoint).eos_token_ids
    )


def test_text_prompts_through_a_gguf_give_the_checkpoint_s_output(demo_gguf):
    checkpoint, path = demo_gguf
    prompts, params = ["class ", "def fib(n):"], greedy(16, ignore_eos=True)
    want = LLM(str(checkpoint)).generate(prompts, params)
    got = LLM(str(path)).generate(prompts, params)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]


def test_the_generate_command_takes_a_gguf_file(demo_gguf, capsys):
    from updraft.cli import main

    _, path = demo_gguf
    argv = ["generate", "--model", str(path), "--prompt", "class ", "--max-tokens", "8"]
    assert main([*argv, "--ignore-eos"]) == 0
    assert capsys.readouterr().out.strip()


def test_updraft_serve_takes_a_gguf_file_and_chats_with_its_template(demo_gguf):
    import httpx

    from tests.serving import start_server_process

    checkpoint, path = demo_gguf
    messages = [{"role": "user", "content": "Write a class"}]
    want = LLM(str(checkpoint)).chat(messages, greedy(12, ignore_eos=True))[0].outputs[0].text
    process, url = start_server_process("--model", str(path))
    try:
        body = {"messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        body["model"] = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == want
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_speculation_over_a_gguf_target_and_draft_changes_no_token(demo_gguf):
    """The F16 file as its own draft model (every draft accepted), and n-gram drafts."""
    _, path = demo_gguf
    prompts, params = ["class ", "def fib(n):"], greedy(24, ignore_eos=True)
    plain = token_ids(LLM(str(path)).generate(prompts, params))
    drafted = LLM(str(path), speculative_model=str(path), num_speculative_tokens=3)
    assert token_ids(drafted.generate(prompts, params)) == plain
    assert drafted.engine.stats().speculative.acceptance_rate == 1.0
    ngram = LLM(str(path), speculative_method="ngram", num_speculative_tokens=3)
    assert token_ids(ngram.generate(prompts, params)) == plain
