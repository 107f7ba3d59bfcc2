"""The int8-activation kernels of the 32-value block types with 4- and 5-bit codes (Q4_1,
Q5_0, Q5_1, IQ4_NL, MXFP4), in the machine's own build (VNNI here) and the AVX2 one
(vpmaddubsw, whose int16 pair sums saturate): rows llama.cpp's own quantizer wrote
(gguf-py's ``quants.quantize``; random valid blocks for IQ4_NL, which it cannot
quantize) and rows of each type's largest codes against x's largest, exact against
the float64 product of the rounded x and gguf-py's dequantized weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from tests.test_gguf import random_blocks
from tests.test_weight_formats import cpu_flags
from updraft.kernels.gguf_ops import (
    BLOCK_TYPES,
    BLOCKS,
    INT8_TYPES,
    gguf_group,
    gguf_linear_int8,
    gguf_round_rows,
    gguf_ungroup,
    int8_kernel_builds,
)

pytestmark = pytest.mark.skipif(not int8_kernel_builds(), reason="the int8 kernel needs AVX2")
KINDS = ["Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4"]
MARCHES = ["native", "haswell"]
K, N = 256, 29  # a last group of five rows


def _march(march: str) -> str:
    if march == "haswell" and not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("the haswell build needs AVX2, FMA and F16C to run here")
    return march


def _file_rows(kind: str, rng: np.random.Generator) -> np.ndarray:
    """N rows of K values in ``kind``'s blocks, as llama.cpp quantizes them where gguf-py
    can (weights of a few scales, so that the blocks' scales differ widely)."""
    if kind == "IQ4_NL":
        return random_blocks(kind, N, K, rng)
    weights = rng.standard_normal((N, K // 32, 32)) * np.exp(rng.uniform(-4, 2, (N, K // 32, 1)))
    return quants.quantize(weights.reshape(N, K).astype(np.float32), GGMLQuantizationType[kind])


def _largest_codes(kind: str, rng: np.random.Generator) -> np.ndarray:
    """Rows whose every code is the type's largest or smallest value (all code bits set
    or all clear; MXFP4's 6 and -6): the products whose pair sums come nearest an
    int16's limit."""
    blocks = random_blocks(kind, N, K, rng).reshape(N, K // 32, -1)
    size = BLOCKS[BLOCK_TYPES[kind]][1]
    codes = blocks[..., size - 16 :]  # the nibbles
    high = blocks[..., size - 20 : size - 16] if kind in ("Q5_0", "Q5_1") else codes[..., :0]
    smallest, largest = (0xFF, 0x77) if kind == "MXFP4" else (0x00, 0xFF)
    for row in range(N):
        codes[row] = high[row] = largest if row % 2 else smallest
    return blocks.reshape(N, -1)


def _check(kind: str, blocks: np.ndarray, x: torch.Tensor, march: str) -> None:
    weight = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType[kind])).double()
    groups = gguf_group(torch.from_numpy(blocks), BLOCK_TYPES[kind], K)
    assert torch.equal(
        gguf_ungroup(groups, BLOCK_TYPES[kind], K, N, torch.arange(N)), torch.from_numpy(blocks)
    )
    bias = torch.randn(N, generator=torch.Generator().manual_seed(7))
    for rows in (1, 3, 8):
        got = gguf_linear_int8(x[:rows], groups, bias, BLOCK_TYPES[kind], K, N, march).double()
        rounded = gguf_round_rows(x[:rows]).double()
        expected = rounded @ weight.T + bias.double()
        # float32's rounding of each block's scaled sum, on the scale of the terms summed
        bound = 1e-5 * (rounded.abs() @ weight.abs().T + bias.double().abs()) + 1e-6
        assert ((got - expected).abs() <= bound).all(), (kind, march, rows)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.usefixtures("all_cores")
def test_llama_cpp_s_quantized_rows_times_int8_x(kind, march):
    assert BLOCK_TYPES[kind] in INT8_TYPES
    rng = np.random.default_rng(BLOCK_TYPES[kind])
    x = torch.randn(8, K, generator=torch.Generator().manual_seed(1))
    x *= torch.exp(torch.empty(8, K // 32, 1).uniform_(-3, 3)).expand(8, K // 32, 32).reshape(8, K)
    _check(kind, _file_rows(kind, rng), x, _march(march))


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("kind", KINDS)
def test_the_largest_codes_times_the_largest_x_do_not_saturate(kind, march):
    rng = np.random.default_rng(BLOCK_TYPES[kind] + 100)
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0])
    x = signs[:, None] * torch.ones(8, K)  # every code +-127
    x[2::4, 1::2] *= -1  # and rows of both signs
    _check(kind, _largest_codes(kind, rng), x, _march(march))
