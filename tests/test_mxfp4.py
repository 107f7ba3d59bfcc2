"""MXFP4: gpt-oss's experts kept in 4.25 bits a weight.

* The block kernel widens MXFP4 (ggml type 39) to the ``gguf`` package's numpy values
  bit for bit over every scale byte and code (subnormal scales included), and its
  products with x equal float64's on those values within float32's rounding, in its
  AVX-512, AVX2 and plain-C builds (``tests/test_gguf.py`` runs its every-type tests
  over MXFP4 too). The installed package's MXFP4 is llama.cpp's own ``gguf-py``.
* A checkpoint's blocks and scales, moved into ggml's nibble order, stand for what
  transformers' ``convert_moe_packed_tensors`` dequantizes them to.
* ``Mxfp4Experts``, read from a checkpoint's blocks, computes what transformers'
  ``GptOssExperts`` computes over the dequantized weights (few rows and many), keeps
  17 bytes per 32 weights, and refuses a tensor of the wrong shape by name.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, quants
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from tests.checkpoints import build_checkpoint
from tests.helpers import greedy, token_ids
from tests.probes import logits_of, probed, records
from tests.test_reference_models import PROMPTS
from updraft.kernels.gguf_ops import BLOCK_TYPES, gguf_dequantize, gguf_linear
from updraft.model_config import ModelConfig
from updraft.models.loader import load_model
from updraft.models.mxfp4_experts import (
    Mxfp4Experts,
    ggml_blocks,
    mxfp4_bytes,
    read_mxfp4_experts,
)

MXFP4 = BLOCK_TYPES["MXFP4"]
PREFIX = "model.layers.0.mlp.experts"


def every_block() -> np.ndarray:
    """256 blocks, one per scale byte; the first 16 hold every code byte once between
    them, the others random ones."""
    rng = np.random.default_rng(0)
    blocks = np.empty((256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256)
    blocks[:, 1:] = rng.integers(0, 256, size=(256, 16))
    blocks[:16, 1:] = np.arange(256, dtype=np.uint8).reshape(16, 16)  # every code byte
    return blocks


def test_every_scale_and_code_widens_to_the_gguf_package_s_values():
    blocks = every_block()
    with np.errstate(over="ignore"):  # 12 * 2^127 is inf in both
        want = quants.dequantize(blocks, GGMLQuantizationType.MXFP4)
    got = gguf_dequantize(torch.from_numpy(blocks), MXFP4, 32).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # twice the E2M1 values times half the scale: 1.5 * 2^0 is code 3 with e = 127
    assert quants.dequantize(np.array([[127, 0x03] + [0] * 15], np.uint8), 39)[0, 0] == 1.5


@pytest.mark.parametrize("march", ["native", "haswell", "x86-64"])
def test_products_equal_float64_s_on_the_widened_values(march):
    """Scales from subnormal (e = 0) to large (e = 140), in each build of the kernel."""
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(24, 4, 17), dtype=np.uint8)
    blocks[..., 0] = rng.integers(0, 141, size=(24, 4))
    blocks = torch.from_numpy(blocks.reshape(24, -1))
    weight = torch.from_numpy(quants.dequantize(blocks.numpy(), 39)).double()
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    for rows in (x[:1], x):
        got = gguf_linear(rows, blocks, None, MXFP4, 128, march=march).double()
        bound = 2e-6 * (rows.double().abs() @ weight.abs().T)
        assert ((got - rows.double() @ weight.T).abs() <= bound).all()


def hf_blocks(experts: int, rows: int, inputs: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random checkpoint blocks [E, rows, inputs / 32, 16] and scales of about 2^-4."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, inputs // 32, 16), generator=generator)
    scales = torch.randint(120, 125, (experts, rows, inputs // 32), generator=generator)
    return blocks.to(torch.uint8), scales.to(torch.uint8)


def test_checkpoint_blocks_move_into_ggml_s_order_with_transformers_values():
    blocks, scales = hf_blocks(3, 5, 96, seed=2)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, rows]
    ours = ggml_blocks(blocks, scales)  # [E, rows, K / 32 * 17]
    assert ours.shape == (3, 5, 3 * 17)
    got = quants.dequantize(ours.numpy(), GGMLQuantizationType.MXFP4)
    assert np.array_equal(got, want.transpose(1, 2).numpy())


CONFIG = GptOssConfig(hidden_size=64, intermediate_size=96, num_local_experts=4)
SHAPE = (4, 64, 96)  # experts, hidden, inter


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """One layer's experts as a checkpoint holds them, and transformers' experts over
    the weights they dequantize to."""
    experts, hidden, inter = SHAPE
    gate_up = hf_blocks(experts, 2 * inter, hidden, seed=3)
    down = hf_blocks(experts, hidden, inter, seed=4)
    generator = torch.Generator().manual_seed(5)
    tensors = {
        f"{PREFIX}.gate_up_proj_blocks": gate_up[0],
        f"{PREFIX}.gate_up_proj_scales": gate_up[1],
        f"{PREFIX}.gate_up_proj_bias": torch.randn(experts, 2 * inter, generator=generator),
        f"{PREFIX}.down_proj_blocks": down[0],
        f"{PREFIX}.down_proj_scales": down[1],
        f"{PREFIX}.down_proj_bias": torch.randn(experts, hidden, generator=generator),
    }
    path = tmp_path_factory.mktemp("mxfp4") / "model.safetensors"
    save_file(
        {name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in tensors.items()},
        path,
    )
    reference = GptOssExperts(CONFIG).eval()
    with torch.no_grad():
        reference.gate_up_proj.copy_(convert_moe_packed_tensors(*gate_up, dtype=torch.float32))
        reference.down_proj.copy_(convert_moe_packed_tensors(*down, dtype=torch.float32))
        reference.gate_up_proj_bias.copy_(tensors[f"{PREFIX}.gate_up_proj_bias"].bfloat16())
        reference.down_proj_bias.copy_(tensors[f"{PREFIX}.down_proj_bias"].bfloat16())
    return path, tensors, reference


def read(path, shape=SHAPE):
    where = {
        f"{PREFIX}.{suffix}": path
        for suffix in (
            "gate_up_proj_blocks",
            "gate_up_proj_scales",
            "gate_up_proj_bias",
            "down_proj_blocks",
            "down_proj_scales",
            "down_proj_bias",
        )
    }
    return read_mxfp4_experts(where, PREFIX, shape, CONFIG.swiglu_alpha, CONFIG.swiglu_limit)


@pytest.mark.parametrize("tokens", [3, 160])
def test_experts_compute_transformers_gpt_oss_experts_on_the_dequantized_weights(
    checkpoint, tokens
):
    """3 tokens: passes of the block kernel; 160 (about 80 rows an expert): widened
    chunks of weight rows."""
    path, _, reference = checkpoint
    experts = read(path)
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=generator)
    chosen = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, 2, generator=generator), dim=1)
    with torch.no_grad():
        want = reference(x, chosen, weights)
        got = experts(x, weights, chosen)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_experts_keep_17_bytes_per_32_weights(checkpoint):
    experts, hidden, inter = SHAPE
    module = read(checkpoint[0])
    weights = experts * (2 * inter * hidden + hidden * inter)
    assert mxfp4_bytes(module) == weights // 32 * 17


def test_a_block_tensor_of_the_wrong_shape_is_refused_by_name(checkpoint, tmp_path):
    _, tensors, _ = checkpoint
    name = f"{PREFIX}.down_proj_blocks"
    bad = dict(tensors, **{name: tensors[name][:, :, :2].contiguous()})
    save_file(bad, tmp_path / "bad.safetensors")
    with pytest.raises(
        ValueError, match=rf"{name} has shape \[4, 64, 2, 16\], not \[4, 64, 3, 16\]"
    ):
        read(tmp_path / "bad.safetensors")


# -- a gpt-oss checkpoint with MXFP4 experts ----------------------------------------------

ENGINE = dict(block_size=4, num_kv_blocks=96)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    """The tiny gpt-oss with MXFP4 experts, and what transformers computes on it,
    dequantizing the experts as it loads: each prompt's greedy tokens and the logits
    they were drawn from."""
    directory = build_checkpoint("gpt-oss-mxfp4", tmp_path_factory.mktemp("gpt-oss-mxfp4"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = reference.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )[0]
            logits = reference(out[None, :-1]).logits[0, len(prompt) - 1 :]
            expected.append((out[len(prompt) :].tolist(), logits))
    return directory, expected


@pytest.mark.parametrize("mode", [{"enforce_eager": True}, {"graph_mode": "full"}])
def test_logits_and_greedy_tokens_equal_transformers_dequantized_model(gpt_oss_mxfp4, mode):
    directory, expected = gpt_oss_mxfp4
    llm = probed(str(directory), **ENGINE, **mode)
    outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS))
    steps = llm.engine.stats().steps
    assert any(step.startswith("graph") for step in steps) != bool(mode.get("enforce_eager"))
    seen = records(llm)
    assert token_ids(outputs) == [tokens for tokens, _ in expected]
    for output, (_, logits) in zip(outputs, expected, strict=True):
        torch.testing.assert_close(logits_of(seen, output), logits, atol=1e-4, rtol=1e-4)


def loaded(directory) -> torch.nn.Module:
    config = ModelConfig.from_dir(directory)
    return load_model(config, directory, torch.float32)


def test_loaded_experts_stay_in_mxfp4_blocks(gpt_oss_mxfp4):
    """17 bytes per 32 expert weights, and no float copy of them anywhere."""
    directory, _ = gpt_oss_mxfp4
    config = ModelConfig.from_dir(directory)
    model = loaded(directory)
    moe = config.moe
    per_layer = moe.num_experts * 3 * moe.moe_intermediate_size * config.hidden_size
    assert mxfp4_bytes(model) == config.num_layers * per_layer // 32 * 17
    experts = [m for m in model.modules() if isinstance(m, Mxfp4Experts)]
    assert len(experts) == config.num_layers
    assert all(m.gate_up.dtype == m.down.dtype == torch.uint8 for m in experts)
    names = [name for name, _ in (*model.named_parameters(), *model.named_buffers())]
    assert not [name for name in names if name.endswith(("gate_up_proj", "down_proj"))]


def test_a_bad_block_tensor_in_a_checkpoint_is_refused_by_name(gpt_oss_mxfp4, tmp_path):
    directory, _ = gpt_oss_mxfp4
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.experts.gate_up_proj_scales"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"model.safetensors: {name} has shape"):
        loaded(tmp_path)


def test_mxfp4_of_an_architecture_without_mxfp4_experts_is_refused_by_name(gpt_oss_mxfp4):
    raw = json.loads((gpt_oss_mxfp4[0] / "config.json").read_text())
    llama = {**raw, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    with pytest.raises(ValueError, match="mxfp4 checkpoint of LlamaForCausalLM"):
        ModelConfig.from_dict(llama)
