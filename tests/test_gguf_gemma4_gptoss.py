"""Gemma 4 and gpt-oss GGUF files as llama.cpp's own converter writes them give what
transformers gives on the weights they hold.

The tiny checkpoints ("gemma4": KV-shared layers, per-layer inputs, a double-wide MLP,
full layers whose values are their keys with their own head size and KV heads,
proportional RoPE; "gemma4-moe": experts beside each dense MLP, here with a tied LM
head; "gpt-oss": sinks, biases, float experts; "gpt-oss-mxfp4": its experts as HF's
MXFP4 blocks) are converted to f32, f16, bf16, q8_0 and (gpt-oss-mxfp4) MXFP4-expert
files in one converter process; one more file has the mixture's experts quantized to
Q5_0 by gguf-py, so that they run through the block kernels with Gemma 4's GELU gate.
The reference is transformers' model of the checkpoint's config with every parameter
set to the values the file holds: read with gguf-py's reader, widened by gguf-py's own
dequantizers and placed by gguf-py's own name map (llama.cpp's), with the converter's
own renames (Gemma 4's router scales) and its documented change to gpt-oss's experts
undone (gate/up columns split, the float ones transposed). Every parameter must be
filled. An f32 file holds the checkpoint exactly; every file, read by updraft, gives the
reference's greedy tokens and logits (eagerly; the per-layer table in blocks and the
MXFP4 experts from captured graphs too). Gemma 4's per-layer table stays in the file's
map, in its type.

The config.json made from a file's metadata gives transformers' config of the
checkpoint; a file missing a tensor, or with a size or key that disagrees, or gpt-oss
experts in a type other than float or MXFP4, is refused naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFReader, get_tensor_name_map, quants

from tests.helpers import greedy
from tests.llama_cpp_tree import convert_checkpoints, llama_cpp_tree
from tests.probes import logits_of, probed, records
from tests.test_gguf_deepseek import rewritten
from updraft import LLM

PROMPTS = [list(range(3, 20)), [200, 17, 9]]  # each past the windows of 8
NEW_TOKENS = 8
# gpt-oss's files state no SwiGLU clamp: llama.cpp fixes gpt-oss's own 7.
GPT_OSS = {"swiglu_limit": 7.0}
# Per-layer inputs of 16 a layer: the table's rows (6 layers) are whole Q8_0 blocks.
GEMMA4 = {"hidden_size_per_layer_input": 16}
# The mixture with its LM head tied to the embedding, as published Gemma 4 files are.
GEMMA4_MOE = {**GEMMA4, "tie_word_embeddings": True}
# name -> (tiny checkpoint, its changes, the converter's outtype)
FILES = {
    "gemma4-f32": ("gemma4", GEMMA4, "f32"),
    "gemma4-f16": ("gemma4", GEMMA4, "f16"),
    "gemma4-bf16": ("gemma4", GEMMA4, "bf16"),
    "gemma4-q8_0": ("gemma4", GEMMA4, "q8_0"),
    "gemma4-moe-f32": ("gemma4-moe", GEMMA4_MOE, "f32"),
    "gemma4-moe-q8_0": ("gemma4-moe", GEMMA4_MOE, "q8_0"),
    "gpt-oss-f32": ("gpt-oss", GPT_OSS, "f32"),
    "gpt-oss-mxfp4": ("gpt-oss-mxfp4", GPT_OSS, "f32"),
}
# Gemma 4's router scales, which the converter names itself (gguf-py's map has them not).
RENAMED_BY_THE_CONVERTER = {
    "scale": "ffn_gate_inp.scale",
    "per_expert_scale": "ffn_down_exps.scale",
}
# Within what updraft's logits match the reference's, by the file's float arithmetic.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (checkpoint, GGUF file), every file converted in one process."""
    llama_cpp_tree()
    root = tmp_path_factory.mktemp("gguf-gemma4-gptoss")
    made = convert_checkpoints(FILES, root)
    # Experts in blocks of another type (Q5_0: no panels) run through the block
    # kernels, with Gemma 4's GELU gate.
    checkpoint, path = made["gemma4-moe-f32"]
    experts = in_blocks(
        GGMLQuantizationType.Q5_0, "ffn_gate_up_exps.weight", "ffn_down_exps.weight"
    )
    made["gemma4-moe-q5_0-experts"] = (checkpoint, root / "gemma4-moe-q5_0-experts.gguf")
    rewritten(path, made["gemma4-moe-q5_0-experts"][1], {}, experts)
    return made


def file_model(checkpoint: Path, path: Path) -> torch.nn.Module:
    """transformers' model of ``checkpoint``'s config (float experts), each parameter
    the values ``path`` holds for it."""
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # its experts come from the file, widened
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reader = GGUFReader(str(path))
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    arch = reader.fields["general.architecture"].contents()
    arch = next(key for key, name in MODEL_ARCH_NAMES.items() if name == arch)
    names = get_tensor_name_map(arch, config.num_hidden_layers)
    used = set()

    def values(name: str) -> torch.Tensor:
        used.add(name)
        tensor = tensors[name]
        kind = tensor.tensor_type
        if kind == GGMLQuantizationType.F32:
            return torch.from_numpy(np.array(tensor.data))
        return torch.from_numpy(quants.dequantize(np.asarray(tensor.data), kind).copy())

    with torch.no_grad():
        for hf, param in weights(model).items():
            if ".mlp.experts." in hf and "gpt_oss" in config.model_type:
                param.copy_(gpt_oss_expert(hf, values))
                continue
            base, _, suffix = hf.rpartition(".")
            found = names.get_name(hf, try_suffixes=(".weight", ".bias", ".scale"))
            if base.endswith(".router") and suffix in RENAMED_BY_THE_CONVERTER:
                found = f"blk.{hf.split('.')[2]}.{RENAMED_BY_THE_CONVERTER[suffix]}"
            if found is None:  # gguf-py maps the module; the suffix is the converter's
                found = names.get_name(base) and f"{names.get_name(base)}.{suffix}"
            if found not in tensors and f"{found}.weight" in tensors:
                found = f"{found}.weight"  # scalars and sinks get a .weight
            assert found in tensors, (hf, found)
            param.copy_(values(found).reshape(param.shape))
    assert set(tensors) - used <= {"rope_freqs.weight", "output.weight"}, set(tensors) - used
    return model


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A transformers model's parameters, and the buffers its checkpoint fills (Gemma
    4's layer scalars)."""
    scalars = {name: b for name, b in model.named_buffers() if name.endswith("layer_scalar")}
    return {**dict(model.named_parameters()), **scalars}


def gpt_oss_expert(hf: str, values) -> torch.Tensor:
    """transformers' gpt-oss expert tensor ``hf`` from the file's split gate and up
    (interleaved back as columns) and its rows-of-inputs weights (transposed back)."""
    layer = hf.split(".")[2]
    blk = f"blk.{layer}"
    if hf.endswith("down_proj"):
        return values(f"{blk}.ffn_down_exps.weight").transpose(1, 2)
    if hf.endswith("down_proj_bias"):
        return values(f"{blk}.ffn_down_exps.bias")
    part = "bias" if hf.endswith("_bias") else "weight"
    gate, up = (values(f"{blk}.ffn_{proj}_exps.{part}") for proj in ("gate", "up"))
    if part == "weight":
        gate, up = gate.transpose(1, 2), up.transpose(1, 2)
    return torch.stack([gate, up], dim=-1).flatten(-2)


@pytest.fixture(scope="module")
def file_models(files):
    """name -> ``file_model`` of that file, made once."""
    cache: dict[str, torch.nn.Module] = {}

    def of(name: str) -> torch.nn.Module:
        if name not in cache:
            cache[name] = file_model(*files[name]).eval()
        return cache[name]

    return of


@pytest.mark.parametrize("name", ["gemma4-f32", "gemma4-moe-f32", "gpt-oss-f32"])
def test_an_f32_file_holds_the_checkpoint(files, file_models, name):
    checkpoint, _ = files[name]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ours = weights(file_models(name))
    for hf, param in weights(theirs).items():
        assert torch.equal(ours[hf], param), hf


# Every file eagerly; the per-layer table in blocks and the MXFP4 experts from
# captured graphs too.
RUNS = [(name, True) for name in sorted(FILES)] + [("gemma4-moe-q5_0-experts", True)]
RUNS += [("gemma4-q8_0", False), ("gpt-oss-mxfp4", False)]


@pytest.mark.parametrize(("name", "eager"), RUNS)
def test_a_converted_file_gives_transformers_tokens_and_logits(files, file_models, name, eager):
    """updraft's greedy tokens are the reference's (each its argmax after the ones
    before), its logits within ``TOLERANCE`` of the reference's."""
    _, path = files[name]
    llm = probed(
        str(path), block_size=4, num_kv_blocks=64, enforce_eager=eager, activations="float32"
    )
    outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS))
    assert ("graph" in llm.engine.stats().steps) != eager
    seen = records(llm)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        tokens = list(output.outputs[0].token_ids)
        sequence = prompt + tokens
        with torch.no_grad():
            expected = file_models(name)(torch.tensor([sequence])).logits[0]
        expected = expected[len(prompt) - 1 : len(sequence) - 1]
        assert expected.argmax(-1).tolist() == tokens, name
        got = logits_of(seen, output)
        assert (got - expected).abs().max().item() < TOLERANCE, name


def test_the_config_is_the_checkpoint_s(files):
    """The config.json made from each file's metadata is transformers' config of the
    checkpoint, field for field (but its dtype and the token ids the file keeps apart)."""
    from updraft.checkpoints.local import local_checkpoint

    left_out = {"dtype", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id"}
    left_out |= {"transformers_version", "quantization_config", "architectures", "_name_or_path"}
    left_out |= {"initializer_range"}  # training's
    for name in ("gemma4-f32", "gemma4-moe-f32", "gpt-oss-f32", "gpt-oss-mxfp4"):
        checkpoint, path = files[name]
        theirs = transformers.AutoConfig.from_pretrained(checkpoint)
        made = json.loads((Path(local_checkpoint(str(path))) / "config.json").read_text())
        made.pop("model_type")  # the file's architecture (gguf.py writes it)
        ours, theirs = type(theirs)(**made).to_dict(), theirs.to_dict()
        for key in sorted((set(ours) | set(theirs)) - left_out):
            assert ours.get(key) == theirs.get(key), (name, key)


def test_the_per_layer_table_stays_in_the_file_s_map_in_its_type(files, monkeypatch):
    from updraft.models import weight_memory
    from updraft.models.gguf_tables import BlockTable
    from updraft.models.mapped_table import MappedEmbedding

    # a real model's table is gigabytes; this one is under the size below which a mapped
    # weight is copied out after loading
    monkeypatch.setattr(weight_memory, "SMALL_MAPPED_BYTES", 0)
    for name, kind in (("gemma4-bf16", torch.bfloat16), ("gemma4-q8_0", None)):
        llm = LLM(str(files[name][1]), block_size=4, num_kv_blocks=16, enforce_eager=True)
        model = llm.engine._runner.model  # noqa: SLF001
        table = model.model.embed_tokens_per_layer
        if kind is None:
            assert isinstance(table, BlockTable) and table.blocks.dtype == torch.uint8
        else:
            assert isinstance(table, MappedEmbedding) and table.weight.dtype == kind
        buffer = table.blocks if kind is None else table.weight
        assert not buffer.untyped_storage().resizable()  # the file's map, not a copy
        llm.engine.close()


def in_blocks(kind: GGMLQuantizationType, *names: str):
    """Each float tensor whose name holds one of ``names`` quantized to ``kind`` blocks
    by gguf-py."""

    def change(tensor):
        if not any(name in tensor.name for name in names):
            return None
        return [(tensor.name, quants.quantize(np.array(tensor.data), kind), kind)]

    return change


def without(name: str):
    return lambda tensor: [] if tensor.name == name else None


def shortened(name: str):
    """The tensor ``name`` less its last row (rows first)."""
    return lambda tensor: (
        [(name, np.array(tensor.data)[:-1], tensor.tensor_type)] if tensor.name == name else None
    )


@pytest.mark.parametrize(
    "name, changed, tensors, message",
    [
        ("gemma4-f32", {}, without("blk.1.attn_k.weight"), "layer 1 lacks blk.1.attn_k.weight"),
        ("gemma4-f32", {}, without("per_layer_token_embd.weight"), "no per_layer_token_embd"),
        ("gemma4-f32", {}, shortened("blk.0.attn_q.weight"), r"blk.0.attn_q.weight has shape"),
        ("gemma4-f32", {"attention.sliding_window_pattern": None}, None, "sliding_window_pattern"),
        (
            "gemma4-f32",
            {"attention.key_length_swa": None},
            None,
            "lacks attention.key_length_swa",
        ),
        ("gemma4-moe-f32", {}, without("blk.0.ffn_down_exps.weight"), "no ffn_down_exps"),
        ("gpt-oss-f32", {}, without("blk.1.attn_sinks.weight"), "layer 1 lacks blk.1.attn_sinks"),
        ("gpt-oss-f32", {}, without("blk.0.ffn_up_exps.bias"), "lacks blk.0.ffn_up_exps.bias"),
        ("gpt-oss-f32", {}, shortened("blk.0.ffn_gate_exps.bias"), "ffn_gate_exps.bias has shape"),
        (
            "gpt-oss-f32",
            {},
            in_blocks(GGMLQuantizationType.Q8_0, "blk.0.ffn_gate_exps.weight"),
            r"are \['F32', 'Q8_0'\]",
        ),
        ("gpt-oss-f32", {"rope.scaling.type": "linear"}, None, "RoPE scaling 'linear'"),
        ("gpt-oss-f32", {"expert_count": None}, None, "lacks expert_count"),
    ],
)
def test_what_cannot_be_read_is_refused_by_name(files, tmp_path, name, changed, tensors, message):
    _, path = files[name]
    bad = rewritten(path, tmp_path / "bad.gguf", changed, tensors or (lambda tensor: None))
    with pytest.raises(ValueError, match=f"bad.gguf: .*{message}"):
        LLM(str(bad), enforce_eager=True)


def test_gpt_oss_s_experts_are_read_on_one_rank(files):
    """Split over tensor-parallel ranks, a gpt-oss file's experts are refused by name:
    their biases have no rank share (the safetensors path keeps them whole)."""
    from updraft.checkpoints.local import local_checkpoint
    from updraft.model_config import ModelConfig
    from updraft.models.gguf_experts import ExpertTensors
    from updraft.models.gpt_oss import GptOssExperts

    config = ModelConfig.from_dir(local_checkpoint(str(files["gpt-oss-f32"][1])))
    modules = {"model.layers.0.mlp.experts": GptOssExperts(config.moe)}
    split = type("TwoRanks", (), {"ranks": 2})()
    experts = ExpertTensors(modules, "x.gguf", split)
    with pytest.raises(ValueError, match=r"x\.gguf: gpt-oss's GGUF experts are read on one rank"):
        experts.take("blk.0.ffn_gate_exps.weight", "F32", np.zeros((4, 32, 64), np.float32))
