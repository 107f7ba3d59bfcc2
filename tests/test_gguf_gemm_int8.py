"""Integer GEMM tiles for a prefill or a batched step (``gguf_gemm_int8``): any number of
rows of x rounded once, as a decode step rounds them, times the weight's groups, gives
row for row what passes of the decode kernel give, and equals the float64 product of
the rounded x and llama.cpp's own dequantization of the weight up to float32 rounding.
GGUFLinear takes every step of more rows than one pass through it."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from tests.test_bound_calls import Dispatched
from tests.test_gguf import random_blocks
from updraft.kernels.gguf_ops import (
    BLOCK_TYPES,
    BLOCKS,
    INT8_MAX_ROWS,
    INT8_TYPES,
    gguf_gemm_int8,
    gguf_gemm_int8_launch,
    gguf_group,
    gguf_linear_int8,
    gguf_round_x,
    int8_kernel_builds,
)
from updraft.models import gguf_loader

pytestmark = pytest.mark.skipif(not int8_kernel_builds(), reason="the int8 kernel needs AVX2")
KINDS = sorted(name for name, code in BLOCK_TYPES.items() if code in INT8_TYPES)
# the machine's own instructions, and AVX2 alone (no AVX-512, no VNNI)
BUILDS = ["native", "haswell"]
ROWS = (11, 17, 64, 300)  # a tile and three rows, two tiles and one, eight tiles, many


@cache
def x_and_rounded(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` rows of x, and each as the kernels round it, in float64 (codes times
    their scale)."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    out = []
    for row in x:
        codes, scales = gguf_round_x(row)
        out.append((codes.view(-1, 32).double() * scales[:, None].double()).view(-1))
    return x, torch.stack(out)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.usefixtures("all_cores")
def test_tiles_give_the_decode_passes_sums_and_the_rounded_x_times_the_weight(kind):
    code = BLOCK_TYPES[kind]
    k = 2 * max(BLOCKS[code][0], 256)
    # 17 groups, the last of three rows: with two threads, chunks of two groups and a
    # last of one
    n = 8 * 16 + 3
    blocks = random_blocks(kind, n, k, np.random.default_rng(n))
    weight = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType[kind])).double()
    groups = gguf_group(torch.from_numpy(blocks), code, k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(0))
    for rows in ROWS:
        x, x64 = x_and_rounded(rows, k)
        passes = torch.cat(
            [gguf_linear_int8(part, groups, bias, code, k, n) for part in x.split(8)]
        )
        expected = x64 @ weight.T + bias.double()
        bound = 1e-5 * (x64.abs() @ weight.abs().T + bias.double().abs()) + 1e-6
        for march in BUILDS:
            got = gguf_gemm_int8(x, groups, bias, code, k, n, march=march)
            scale = passes.abs().max().item()
            torch.testing.assert_close(got, passes, rtol=1e-6, atol=1e-6 * scale)
            assert ((got.double() - expected).abs() <= bound).all(), (rows, march)


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.usefixtures("all_cores")
def test_two_groups_at_once_give_the_decode_passes_sums(kind):
    """Where the CPU has AVX-512 VNNI, these types' tiles take two groups at once (lanes
    0-7 and 8-15 of one register): a last pair whose second group is short of eight rows
    (32 groups, the last of three rows, in chunks of four), tiles of 32 + 16 + 8 + 4 + 2
    + 1 rows (a whole tile and every kernel a tail is made of), and 8 + 2 + 1, give what
    the decode passes give."""
    code = BLOCK_TYPES[kind]
    k, n = 512, 8 * 31 + 3
    blocks = random_blocks(kind, n, k, np.random.default_rng(n))
    groups = gguf_group(torch.from_numpy(blocks), code, k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(0))
    for rows in (63, 11):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
        passes = torch.cat(
            [gguf_linear_int8(part, groups, bias, code, k, n) for part in x.split(8)]
        )
        got = gguf_gemm_int8(x, groups, bias, code, k, n)
        scale = passes.abs().max().item()
        torch.testing.assert_close(got, passes, rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize("kind", ["Q4_K"])
def test_a_linear_takes_many_rows_through_the_tiles(kind):
    """More rows than a decode pass takes go through ``gguf_gemm_int8`` alone (nothing
    widened to float32), and give what the decode kernel gives row by row: a request's
    tokens do not depend on whether a long prompt shared its step. A replayed graph
    may run the call over its leading rows alone."""
    k, n = 512, 70
    blocks = torch.from_numpy(random_blocks(kind, n, k, np.random.default_rng(3)))
    linear = gguf_loader.GGUFLinear(k, [gguf_loader.Part(blocks, BLOCK_TYPES[kind])], None, True)
    x = torch.randn(100, k, generator=torch.Generator().manual_seed(4))
    with Dispatched() as seen:
        many = linear(x)
    assert [op for op in seen.ops if op.startswith("updraft.")] == [
        "updraft.gguf_gemm_int8.default"
    ]
    steps = torch.cat([linear(rows) for rows in x.split(INT8_MAX_ROWS)])
    torch.testing.assert_close(many, steps, rtol=1e-6, atol=1e-6 * steps.abs().max().item())
    with Dispatched() as seen:
        linear(x[:INT8_MAX_ROWS])
    assert [op for op in seen.ops if op.startswith("updraft.")] == [
        "updraft.gguf_linear_int8.default"
    ]

    out = torch.full((100, n), 7.0)
    launch = gguf_gemm_int8_launch(x, linear.part0, None, BLOCK_TYPES[kind], k, n, out=(out,))
    assert launch.rows == 100
    launch.leading_rows(20)
    torch.testing.assert_close(out[:20], many[:20], rtol=1e-6, atol=1e-6 * many.abs().max().item())
    assert (out[20:] == 7.0).all()
