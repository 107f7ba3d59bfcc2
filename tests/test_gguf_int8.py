"""The int8-activation GGUF kernel: x rounded to int8 in blocks of 32, as ggml's Q8_0
rounds it, times the weight's blocks regrouped eight rows at a time, equals the float64
product of the rounded x and the dequantized weight up to float32 rounding; the groups
hold the file's bytes exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from benchmarks.peers import make_gguf
from tests.helpers import greedy, token_ids
from tests.probes import logits_of, probed, records
from tests.test_gguf import MIXES, convert_to, plain, random_blocks
from tests.test_reference_models import PROMPTS
from updraft import LLM
from updraft.kernels.gguf_ops import (
    BLOCK_TYPES,
    BLOCKS,
    INT8_TYPES,
    gguf_dequantize,
    gguf_dequantize_groups,
    gguf_group,
    gguf_linear_int8,
    gguf_round_rows,
    gguf_round_x,
    gguf_ungroup,
    int8_kernel_builds,
)
from updraft.models import gguf_loader
from updraft.models.packed_linear import PackedLinear

pytestmark = pytest.mark.skipif(not int8_kernel_builds(), reason="the int8 kernel needs AVX2")
KINDS = sorted(name for name, code in BLOCK_TYPES.items() if code in INT8_TYPES)


def test_x_is_rounded_as_q8_0_rounds_it():
    x = torch.randn(512, generator=torch.Generator().manual_seed(0)) * 3
    x[64:96] = 0.0  # a block of zeros stays zeros
    codes, scales = gguf_round_x(x)
    blocks = x.view(-1, 32)
    torch.testing.assert_close(scales, blocks.abs().amax(1) / 127, rtol=1e-7, atol=0)
    ratio = torch.where(scales[:, None] > 0, blocks / scales[:, None], torch.zeros_like(blocks))
    assert ((codes.view(-1, 32).float() - ratio).abs() <= 0.5 + 1e-5).all()
    assert codes.abs().max() == 127 and (codes[64:96] == 0).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 8, 8 * 5 - 3])
def test_groups_hold_the_file_s_bytes_and_give_back_any_row(kind, rows):
    k = 512
    blocks = torch.from_numpy(random_blocks(kind, rows, k, np.random.default_rng(rows)))
    groups = gguf_group(blocks, BLOCK_TYPES[kind], k)
    assert groups.shape[0] == -(-rows // 8)
    # the same bytes in another order (Q4_K's six-bit scales decoded to a byte each)
    extra = {"Q4_K": 1184 / 1152}.get(kind, 1.0)
    assert groups.numel() == pytest.approx(-(-rows // 8) * 8 * blocks.shape[1] * extra)
    every = torch.arange(rows)
    assert torch.equal(gguf_ungroup(groups, BLOCK_TYPES[kind], k, rows, every), blocks)
    picked = torch.tensor([rows - 1, 0, rows // 2, rows - 1])
    assert torch.equal(gguf_ungroup(groups, BLOCK_TYPES[kind], k, rows, picked), blocks[picked])
    widened = gguf_dequantize_groups(groups, BLOCK_TYPES[kind], k, rows, picked)
    assert torch.equal(widened, gguf_dequantize(blocks[picked].contiguous(), BLOCK_TYPES[kind], k))
    with pytest.raises(IndexError, match="a row outside"):
        gguf_ungroup(groups, BLOCK_TYPES[kind], k, rows, torch.tensor([rows]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.usefixtures("all_cores")
def test_int8_x_times_groups_equals_the_rounded_x_times_the_dequantized_weight(kind):
    values = BLOCKS[BLOCK_TYPES[kind]][0]
    k = 3 * max(values, 256)
    n = 37  # a last group of five rows
    blocks = random_blocks(kind, n, k, np.random.default_rng(1))
    weight = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType[kind])).double()
    groups = gguf_group(torch.from_numpy(blocks), BLOCK_TYPES[kind], k)
    bias = torch.randn(n)
    generator = torch.Generator().manual_seed(2)
    for rows in (1, 3, 8):
        for scale in (1.0, 1e-3, 50.0):
            x = torch.randn(rows, k, generator=generator) * scale
            got = gguf_linear_int8(x, groups, bias, BLOCK_TYPES[kind], k, n)
            rounded = torch.stack([_rounded(row) for row in x])
            expected = rounded @ weight.T + bias.double()
            bound = 1e-5 * (rounded.abs() @ weight.abs().T + bias.double().abs()) + 1e-6
            assert ((got.double() - expected).abs() <= bound).all(), (rows, scale)
            # and it is not the float32 product: x was rounded
            assert not torch.allclose(got.double(), x.double() @ weight.T + bias.double(), atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_prefill_takes_x_as_a_decode_step_does(kind):
    """A prefill's many rows go through integer tiles (``gguf_gemm_int8``), x rounded as
    the decode kernel rounds it: row for row, the output is a decode step's up to
    float32 rounding, so a request's tokens do not depend on whether a long prompt
    shared its step (without the rounding, the rows differ by about a percent)."""
    k, n = 512, 70
    blocks = torch.from_numpy(random_blocks(kind, n, k, np.random.default_rng(3)))
    linear = gguf_loader.GGUFLinear(k, [gguf_loader.Part(blocks, BLOCK_TYPES[kind])], None, True)
    assert linear.grouped == [True]
    x = torch.randn(100, k, generator=torch.Generator().manual_seed(4))
    many = linear(x)  # more rows than a decode step's pass takes: the tiles
    steps = torch.cat([linear(rows) for rows in x.split(8)])  # the int8 kernel
    torch.testing.assert_close(many, steps, rtol=1e-5, atol=1e-5 * steps.abs().max().item())
    rounded = gguf_round_rows(x)
    assert torch.equal(rounded[7], _rounded(x[7]).float())


def test_a_type_without_an_int8_kernel_keeps_its_blocks_and_takes_x_unrounded():
    """Under int8 activations a part in a type ``gguf_int8.c`` does not multiply (Q5_K
    here) stays in the file's blocks and computes the float path's product, beside a
    Q4_K part that is regrouped and rounds x."""
    k = 256
    rng = np.random.default_rng(5)
    q4 = gguf_loader.Part(torch.from_numpy(random_blocks("Q4_K", 16, k, rng)), BLOCK_TYPES["Q4_K"])
    q5 = gguf_loader.Part(torch.from_numpy(random_blocks("Q5_K", 24, k, rng)), BLOCK_TYPES["Q5_K"])
    assert BLOCK_TYPES["Q5_K"] not in INT8_TYPES
    linear = gguf_loader.GGUFLinear(k, [q4, q5], None, True)
    assert linear.grouped == [True, False]
    assert torch.equal(linear.part1, q5.weight)
    floats = gguf_loader.GGUFLinear(k, [q5], None)
    generator = torch.Generator().manual_seed(5)
    for rows in (1, 100):  # a decode step's kernel, a prefill's widened rows
        x = torch.randn(rows, k, generator=generator)
        assert torch.equal(linear(x)[:, 16:], floats(x))


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it, in float64."""
    codes, scales = gguf_round_x(x)
    return (codes.view(-1, 32).double() * scales[:, None].double()).view(-1)


# -- a model from a file --------------------------------------------------------------------


def one_at_a_time(model, **args) -> tuple[list[list[int]], list[torch.Tensor], LLM]:
    """Each prompt generated alone (decode steps of one row, where x is rounded)."""
    llm = probed(str(model), block_size=4, num_kv_blocks=64, **args)
    outputs = [llm.generate([prompt], greedy(8))[0] for prompt in PROMPTS]
    seen = records(llm)
    return token_ids(outputs), [logits_of(seen, output) for output in outputs], llm


@pytest.mark.parametrize("mix", ["Q8_0", "Q4_K_M"])
def test_int8_activations_move_the_logits_by_about_the_rounding(tmp_path, mix):
    """With ``activations="int8"`` every linear that takes one row (a decode step's, and
    the LM head's at the end of a prefill) rounds x: the logits move by about the
    rounding, a percent of their scale, no more."""
    shape = {"hidden_size": 256, "intermediate_size": 512}
    checkpoint = plain("qwen3", tmp_path / "hf", **shape)
    path = tmp_path / "model.gguf"
    make_gguf.main(checkpoint, path, convert_to(MIXES[mix], np.random.default_rng(1), {}))
    exact = one_at_a_time(path)
    rounded = one_at_a_time(path, activations="int8")
    modules = list(rounded[2].engine._runner.model.modules())  # noqa: SLF001
    assert all(m.int8 for m in modules if isinstance(m, gguf_loader.GGUFLinear))
    assert not [m for m in modules if isinstance(m, PackedLinear) and m.format.quantized]
    pairs = zip(rounded[0], exact[0], rounded[1], exact[1], strict=True)
    for tokens, theirs_tokens, ours, theirs in pairs:
        # the logits of each step up to the first token the two draw differently
        drawn = zip(tokens, theirs_tokens, strict=True)
        split = next((i for i, (a, b) in enumerate(drawn) if a != b), None)
        steps = slice(0, None if split is None else split + 1)
        scale = theirs.abs().max()
        difference = (ours[steps] - theirs[steps]).abs().max()
        assert 1e-3 * scale < difference <= 0.03 * scale, (difference, scale)


def test_int8_activations_are_refused_for_a_float_safetensors_checkpoint(tmp_path):
    checkpoint = plain("qwen3", tmp_path / "hf")
    with pytest.raises(ValueError, match="activations int8 is for quantized weights"):
        LLM(str(checkpoint), activations="int8")
