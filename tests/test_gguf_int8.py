"""The int8-activation GGUF kernel: x rounded to int8 in blocks of 32, as ggml's Q8_0
rounds it, times the weight's blocks regrouped eight rows at a time, equals the float64
product of the rounded x and the dequantized weight up to float32 rounding, in every
build (VNNI, AVX2 alone, portable C); the groups hold the file's bytes exactly."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from benchmarks.peers import make_gguf
from tests.helpers import greedy, token_ids
from tests.probes import logits_of, probed, records
from tests.test_gguf import MIXES, convert_to, plain, random_blocks
from tests.test_reference_models import PROMPTS
from tests.test_weight_formats import cpu_flags
from updraft import LLM
from updraft.kernels.gguf_ops import (
    BLOCK_TYPES,
    BLOCKS,
    INT8_TYPES,
    gguf_dequantize,
    gguf_dequantize_groups,
    gguf_group,
    gguf_int8_unpack,
    gguf_linear_int8,
    gguf_round_rows,
    gguf_round_x,
    gguf_ungroup,
    int8_kernel_builds,
    int8_simd_level,
)
from updraft.models import gguf_loader
from updraft.models.packed_linear import PackedLinear

pytestmark = pytest.mark.skipif(not int8_kernel_builds(), reason="no C compiler on PATH")
KINDS = sorted(name for name, code in BLOCK_TYPES.items() if code in INT8_TYPES)
# The kernel's builds: this CPU's own (VNNI here), AVX2 without VNNI, and no SIMD at all
# (the portable C path, over each type's unpack_).
MARCHES = ("native", "haswell", "x86-64")
K, N = 512, 37  # a last group of five rows


def _skip_unless_runs(march: str) -> None:
    if march == "haswell" and not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU cannot run AVX2 code")


@cache
def _weight(kind: str) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """N rows of K values in ``kind``'s blocks (random, valid), their groups, and their
    values as llama.cpp's gguf-py dequantizes them (float64)."""
    blocks = random_blocks(kind, N, K, np.random.default_rng(7))
    groups = gguf_group(torch.from_numpy(blocks), BLOCK_TYPES[kind], K)
    weight = quants.dequantize(blocks, GGMLQuantizationType[kind])
    return blocks, groups, torch.from_numpy(weight).double()


def test_the_native_build_multiplies_bytes_with_the_cpu_s_widest_instructions():
    flags = cpu_flags()
    vnni = {"avx512_vnni", "avx512vl"} <= flags or "avx_vnni" in flags
    simd = {"avx2", "fma", "f16c"} <= flags
    assert int8_simd_level("native") == (2 if vnni and simd else 1 if simd else 0)
    assert int8_simd_level("x86-64") == 0
    if simd:
        assert int8_simd_level("haswell") == 1


@pytest.mark.parametrize("march", MARCHES)
def test_every_build_rounds_x_to_the_same_codes(march):
    """ggml's rounding (its SIMD form): scale max |x| / 127, codes x * (127 / max |x|) in
    float32, rounded half to even, clamped to +-127; a zero block stays zero."""
    _skip_unless_runs(march)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1024, generator=generator) * torch.logspace(-6, 6, 1024)
    x[64:96] = 0.0
    x[96:128] = torch.arange(-16, 16) + 0.5  # exact halves: factor 127 / 127
    x[127] = 127.0
    codes, scales = gguf_round_x(x, march=march)
    blocks = x.numpy().reshape(-1, 32)
    top = np.abs(blocks).max(1)
    factor = np.where(top > 0, np.float32(127) / np.where(top > 0, top, 1), 0).astype(np.float32)
    want = np.clip(np.rint(blocks * factor[:, None]), -127, 127)
    assert np.array_equal(codes.numpy().reshape(-1, 32), want)
    assert codes[96:100].tolist() == [-16, -14, -14, -12]  # -15.5, -14.5, -13.5, -12.5
    assert (codes[64:96] == 0).all() and scales[2] == 0
    torch.testing.assert_close(scales, torch.from_numpy(top / 127), rtol=1.2e-7, atol=0)
    native_codes, native_scales = gguf_round_x(x)
    assert torch.equal(codes, native_codes) and torch.equal(scales, native_scales)


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_unpacked_is_the_gguf_package_s_values(kind):
    """Each type's ``unpack_`` (what the portable kernel multiplies): value i =
    scale[i / 16] * codes[i] + min[i / 16], which float32 rounds to gguf-py's value."""
    _, groups, weight = _weight(kind)
    values = BLOCKS[BLOCK_TYPES[kind]][0]
    blocks = K // values
    for row in (0, 13, N - 1):
        for b in range(blocks):
            codes, scale, low = gguf_int8_unpack(
                groups, BLOCK_TYPES[kind], row // 8 * blocks + b, row % 8
            )
            exact = codes.double() * scale.double().repeat_interleave(16)
            exact += low.double().repeat_interleave(16)
            assert torch.equal(exact.float(), weight[row, b * values : (b + 1) * values].float())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.usefixtures("all_cores")
def test_every_build_multiplies_the_rounded_x_by_the_dequantized_weight(kind, march):
    """1 to 64 rows of x (in decode passes of up to 8), K of two 256-value blocks, N not a
    multiple of 8. The reference: x as rounded @ llama.cpp's dequantized weight, in
    float64. The kernel's integer sums are exact; each sum of 16 or 32 products is
    scaled in float32 (at most three roundings) and the K / 16 scaled sums added (one
    rounding each), so the error is within (K / 16 + 3) float32 ulps of the sum of the
    products' magnitudes; twice that for a minimum's part taken off after (Q4_K)."""
    _skip_unless_runs(march)
    _, groups, weight = _weight(kind)
    code = BLOCK_TYPES[kind]
    bias = torch.randn(N, generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(2)
    for rows, scale in ((1, 1.0), (3, 1e-3), (8, 50.0), (17, 1.0), (64, 3.0)):
        x = torch.randn(rows, K, generator=generator) * scale
        got = torch.cat(
            [gguf_linear_int8(part, groups, bias, code, K, N, march=march) for part in x.split(8)]
        )
        rounded = gguf_round_rows(x, march=march).double()
        expected = rounded @ weight.T + bias.double()
        ulps = 2 * (K // 16 + 3) * 2.0**-24
        bound = ulps * (rounded.abs() @ weight.abs().T + bias.double().abs())
        assert ((got.double() - expected).abs() <= bound).all(), (rows, scale)
    # and x was rounded: not the float32 product
    assert not torch.allclose(got.double(), x.double() @ weight.T + bias.double(), atol=0)


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_one_row_of_x_takes_weights_of_any_shape(kind):
    """A decode step's one row of x runs two parts of a group per register where the
    build has AVX-512 VNNI (int8_decode.h): weights of 1 to 100 rows (a last group short
    of eight, counts not a multiple of 16), an odd number of blocks (Q4_0's and Q8_0's
    last block alone) and a single 256-value block, with a bias and without, against
    the reference and bound above."""
    code = BLOCK_TYPES[kind]
    widths = (256, 512) if BLOCKS[code][0] == 256 else (96, 480, 512)
    generator = torch.Generator().manual_seed(5)
    for k in widths:
        for n in (1, 3, 8, 13, 16, 17, 24, 64, 100):
            blocks = random_blocks(kind, n, k, np.random.default_rng(n + k))
            groups = gguf_group(torch.from_numpy(blocks), code, k)
            weight = quants.dequantize(blocks, GGMLQuantizationType[kind])
            weight = torch.from_numpy(weight).double()
            x = torch.randn(1, k, generator=generator) * 2
            rounded = gguf_round_rows(x).double()
            for bias in (None, torch.randn(n, generator=generator)):
                got = gguf_linear_int8(x, groups, bias, code, k, n).double()
                expected = rounded @ weight.T + (0.0 if bias is None else bias.double())
                magnitude = rounded.abs() @ weight.abs().T
                if bias is not None:
                    magnitude = magnitude + bias.double().abs()
                bound = 2 * (k // 16 + 3) * 2.0**-24 * magnitude
                assert ((got - expected).abs() <= bound).all(), (k, n, bias is None)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_the_avx2_one_row_kernels_give_the_eight_row_kernels_bits(kind):
    """An AVX2 build without VNNI runs one row of x through its own kernels
    (int8_decode_avx2.h), and two or more rows through the eight-row ones: the same
    integer sums scaled in the same order, so row 0 of a two-row call is the one-row
    result bit for bit (a bound would let a wrong scale order through), with and
    without a bias, over a last group short of eight."""
    _skip_unless_runs("haswell")
    code = BLOCK_TYPES[kind]
    k = 512
    blocks = random_blocks(kind, 21, k, np.random.default_rng(11))
    groups = gguf_group(torch.from_numpy(blocks), code, k)
    generator = torch.Generator().manual_seed(12)
    for scale in (1.0, 1e-3, 40.0):
        x = torch.randn(2, k, generator=generator) * scale
        for bias in (None, torch.randn(21, generator=generator)):
            one = gguf_linear_int8(x[:1], groups, bias, code, k, 21, march="haswell")
            two = gguf_linear_int8(x, groups, bias, code, k, 21, march="haswell")
            assert torch.equal(one.view(torch.int32), two[:1].view(torch.int32)), (scale, bias)


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
    # the same bytes in another order (the K-quants' and IQ4_XS's packed six-bit scales
    # decoded to a byte each)
    extra = {"Q4_K": 1184 / 1152, "Q3_K": 912 / 880, "Q5_K": 1440 / 1408, "IQ4_XS": 1104 / 1088}
    extra = extra.get(kind, 1.0)
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
    """With int8 activations (a quantized file's default) every linear that takes one
    row (a decode step's, and the LM head's at the end of a prefill) rounds x: the
    logits move by about the rounding, a percent of their scale, no more, from those of
    ``activations="float32"``."""
    shape = {"hidden_size": 256, "intermediate_size": 512}
    checkpoint = plain("qwen3", tmp_path / "hf", **shape)
    path = tmp_path / "model.gguf"
    make_gguf.main(checkpoint, path, convert_to(MIXES[mix], np.random.default_rng(1), {}))
    exact = one_at_a_time(path, activations="float32")
    rounded = one_at_a_time(path)
    modules = list(rounded[2].engine._runner.model.modules())  # noqa: SLF001
    assert all(all(m.grouped) for m in modules if isinstance(m, gguf_loader.GGUFLinear))
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
