"""Weight-only int8 (``quantization="int8"``): the kernel computes the dequantized
float32 product, and the engine's tokens equal a float32 engine on a checkpoint whose
weights are the dequantized int8 ones."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tests.helpers import greedy
from updraft import LLM
from updraft.config import ModelConfig
from updraft.models.int8_linear import Int8Linear, quantize_weight
from updraft.models.loader import load_model

from .conftest import make_tiny_checkpoint
from .probes import logits_of, probed, records


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_weight(weight)
    return q.float() * scale[:, None]


def test_quantization_is_per_output_channel_and_within_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(40, 33) * torch.logspace(-3, 2, 40)[:, None]  # rows of any scale
    q, scale = quantize_weight(weight)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert scale.shape == (40,)
    assert ((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_equals_f_linear_on_the_dequantized_weight(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(100, 37, bias=bias)  # K not a multiple of any vector width
    x = torch.randn(rows, 100)
    expected = F.linear(x, dequantized(linear.weight), linear.bias)
    torch.testing.assert_close(Int8Linear(linear)(x), expected, atol=1e-5, rtol=1e-5)
    assert Int8Linear(linear)(x.view(rows, 1, 100)).shape == (rows, 1, 37)


# What int8 leaves in float: embeddings, and DeepSeek's weights that are not linear
# layers (the absorbed kv_b_proj, the router, the stacked experts).
KEPT_IN_FLOAT = ("embed_tokens", "kv_b_proj", "mlp.gate.weight", ".experts.")


def dequantized_checkpoint(source, directory):
    """``source`` with every linear weight replaced by its int8 dequantization; the LM
    head untied, since int8 quantizes it and keeps the embedding in float32."""
    shutil.copytree(source, directory)
    tensors = load_file(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        config["tie_word_embeddings"] = False
        (directory / "config.json").write_text(json.dumps(config))
    for name, tensor in tensors.items():
        if tensor.dim() == 2 and not any(part in name for part in KEPT_IN_FLOAT):
            tensors[name] = dequantized(tensor).contiguous()
    save_file(tensors, directory / "model.safetensors")
    return directory


@pytest.mark.parametrize("kind", ["llama", "qwen2", "deepseek-v3.2"])
def test_int8_engine_equals_float32_on_the_dequantized_weights(kind, tmp_path):
    from tests.conftest import make_deepseek_checkpoint

    make = make_deepseek_checkpoint if kind.startswith("deepseek") else make_tiny_checkpoint
    source = make(kind, tmp_path / "source")
    reference_dir = dequantized_checkpoint(source, tmp_path / "dequantized")
    prompts = [[1, 2, 3, 4, 5], list(range(40, 80)), [7] * 19]
    params = greedy(16)
    logits = {}
    tokens = {}
    for name, llm in [
        ("reference", probed(reference_dir, num_kv_blocks=32, enforce_eager=True)),
        ("int8", probed(source, num_kv_blocks=32, quantization="int8", enforce_eager=True)),
        (
            "int8 graphs",
            probed(source, num_kv_blocks=32, quantization="int8", compile_graphs=False),
        ),
        (
            "int8 compiled",
            probed(
                source,
                num_kv_blocks=32,
                quantization="int8",
                compile_graphs=True,
                capture_sizes=(1, 4),
            ),
        ),
    ]:
        outputs = llm.generate(prompts, params)
        seen = records(llm)
        tokens[name] = [output.outputs[0].token_ids for output in outputs]
        logits[name] = [logits_of(seen, output) for output in outputs]
    assert tokens["int8"] == tokens["reference"] == tokens["int8 graphs"]
    for got, want in zip(logits["int8"], logits["reference"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for got, want in zip(logits["int8 graphs"], logits["int8"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Fused kernels round differently from the ops they replace.
    assert tokens["int8 compiled"] == tokens["int8"]
    for got, want in zip(logits["int8 compiled"], logits["int8"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_int8_replaces_every_linear_and_keeps_the_embedding(tiny_llama):
    config = ModelConfig.from_dir(tiny_llama)
    model = load_model(config, tiny_llama, torch.float32, quantization="int8")
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 2 * 4 + 1
    assert model.model.embed_tokens.weight.dtype == torch.float32


def test_bad_quantization_settings_are_named(tiny_llama):
    with pytest.raises(ValueError, match="quantization must be one of int8, got 'int4'"):
        LLM(tiny_llama, num_kv_blocks=16, quantization="int4")
    with pytest.raises(ValueError, match="int8' runs on the CPU in float32"):
        LLM(tiny_llama, num_kv_blocks=16, quantization="int8", dtype="bfloat16")
