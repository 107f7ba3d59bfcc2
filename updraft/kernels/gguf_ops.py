"""GGUF's quantized blocks as torch ops over ``kernels/gguf_blocks.c``:
``updraft::gguf_linear`` (a few rows of x against a weight in blocks, widened in
registers) and ``updraft::gguf_dequantize`` (rows of blocks to float32: an embedding's
looked-up rows, a prefill's chunk of weight rows, and tests).

A weight is a uint8 tensor [N, row_bytes], each row K / B blocks as the file holds them.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from updraft import gguf_checkpoint
from updraft.kernels.build import load
from updraft.kernels.ops import Launch

# ggml's type numbers of the block types read here, and (values, bytes) per block, as
# the gguf package has them (the kernel's own switch must agree: tests/test_gguf.py).
BLOCK_TYPES = {name: GGMLQuantizationType[name].value for name in gguf_checkpoint.BLOCK_TYPES}
BLOCKS = {code: GGML_QUANT_SIZES[GGMLQuantizationType(code)] for code in BLOCK_TYPES.values()}
# Up to this many rows of x the kernel runs (its partial sums live in registers and
# the stack); more rows widen a chunk of weight rows and multiply it with torch.
GGUF_MAX_ROWS = 8

_POINTER = ctypes.c_void_p
_INT = ctypes.c_int64


@cache
def _library(march: str = "native") -> ctypes.CDLL:
    """The kernel built for ``march`` (another than the machine's own lets a test run
    its portable path: ``haswell`` has no AVX-512)."""
    lib = load("gguf_blocks", march)
    lib.gguf_dequantize.restype = None
    lib.gguf_dequantize.argtypes = [
        ctypes.c_int,
        _POINTER,
        _INT,
        _INT,
        _INT,
        _POINTER,
        ctypes.c_int,
    ]
    lib.gguf_linear.restype = None
    lib.gguf_linear.argtypes = [ctypes.c_int, _POINTER, _INT, _INT, _POINTER, _INT, _INT]
    lib.gguf_linear.argtypes += [_POINTER, _POINTER, ctypes.c_int]
    return lib


def gguf_kernel_builds() -> bool:
    try:
        _library()
    except RuntimeError:
        return False
    return True


def _check(blocks: torch.Tensor, block_type: int, k: int) -> int:
    """Bytes of one row of ``blocks``; refuses what the kernel cannot read."""
    if block_type not in BLOCKS:
        raise TypeError(f"updraft::gguf ops take ggml block types {sorted(BLOCKS)}")
    values, size = BLOCKS[block_type]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
        raise TypeError("updraft::gguf ops take contiguous uint8 blocks [rows, row_bytes]")
    if k % values or blocks.shape[1] != k // values * size:
        raise TypeError(f"rows of {blocks.shape[1]} bytes are not {k} values in blocks of {values}")
    return blocks.shape[1]


def gguf_dequantize(blocks: torch.Tensor, block_type: int, k: int) -> torch.Tensor:
    """blocks [R, row_bytes] -> the float32 rows [R, k] they stand for."""
    row_bytes = _check(blocks, block_type, k)
    out = torch.empty(blocks.shape[0], k)
    _library().gguf_dequantize(
        block_type,
        blocks.data_ptr(),
        blocks.shape[0],
        k,
        row_bytes,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def gguf_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    bias: torch.Tensor | None,
    block_type: int,
    k: int,
    march: str = "native",
) -> torch.Tensor:
    """x [M, k] float32 (M <= GGUF_MAX_ROWS) @ the weight in ``blocks`` [N, row_bytes]
    transposed (+ bias) -> [M, N]."""
    return gguf_linear_launch(x, blocks, bias, block_type, k, march)()[0]


def gguf_linear_launch(
    x: torch.Tensor,
    blocks: torch.Tensor,
    bias: torch.Tensor | None,
    block_type: int,
    k: int,
    march: str = "native",
    out: tuple[torch.Tensor, ...] | None = None,
) -> Launch:
    """``gguf_linear``'s checked call, into ``out`` (else a new tensor)."""
    row_bytes = _check(blocks, block_type, k)
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise TypeError(f"updraft::gguf_linear takes float32 x [rows, {k}]")
    if x.shape[0] > GGUF_MAX_ROWS:
        raise TypeError(f"updraft::gguf_linear takes at most {GGUF_MAX_ROWS} rows")
    given = (x, bias)
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    n = blocks.shape[0]
    (y,) = out or (x.new_empty(x.shape[0], n),)
    if y.shape != (x.shape[0], n) or y.dtype != torch.float32 or not y.is_contiguous():
        raise TypeError("updraft::gguf_linear writes a contiguous float32 output")
    return Launch(
        _library(march).gguf_linear,
        (
            block_type,
            x.data_ptr(),
            x.shape[0],
            k,
            blocks.data_ptr(),
            n,
            row_bytes,
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            torch.get_num_threads(),
        ),
        (y,),
        (x, blocks, bias),
        any(a is not b for a, b in zip(given, (x, bias), strict=True)),
    )


_FRAGMENT = torch.library.Library("updraft", "FRAGMENT")
_FRAGMENT.define("gguf_dequantize(Tensor blocks, int block_type, int k) -> Tensor")
_FRAGMENT.impl("gguf_dequantize", gguf_dequantize, "CPU")
_FRAGMENT.impl(
    "gguf_dequantize",
    lambda blocks, block_type, k: blocks.new_empty(blocks.shape[0], k, dtype=torch.float32),
    "Meta",
)
_FRAGMENT.define(
    "gguf_linear(Tensor x, Tensor blocks, Tensor? bias, int block_type, int k) -> Tensor"
)
_FRAGMENT.impl(
    "gguf_linear",
    lambda x, blocks, bias, block_type, k: gguf_linear(x, blocks, bias, block_type, k),
    "CPU",
)
_FRAGMENT.impl(
    "gguf_linear",
    lambda x, blocks, bias, block_type, k: x.new_empty(x.shape[0], blocks.shape[0]),
    "Meta",
)
