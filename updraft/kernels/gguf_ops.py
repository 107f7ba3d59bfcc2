"""GGUF's quantized blocks as torch ops over ``kernels/gguf_blocks.c``:
``updraft::gguf_linear`` (a few rows of x against a weight in blocks, widened in
registers) and ``updraft::gguf_dequantize`` (rows of blocks to float32: an embedding's
looked-up rows, a prefill's chunk of weight rows, and tests).

A weight is a uint8 tensor [N, row_bytes], each row K / B blocks as the file holds them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from updraft import gguf_checkpoint
from updraft.kernels.build import load
from updraft.kernels.ops import Launch, reads_copies, writable_output

# ggml's type numbers of the block types read here, and (values, bytes) per block, as
# the gguf package has them (the kernel's own switch must agree: tests/test_gguf.py).
BLOCK_TYPES = {name: GGMLQuantizationType[name].value for name in gguf_checkpoint.BLOCK_TYPES}
BLOCKS = {code: GGML_QUANT_SIZES[GGMLQuantizationType(code)] for code in BLOCK_TYPES.values()}
# Up to this many rows of x the kernel runs (its partial sums live in registers and
# the stack); more rows widen a chunk of weight rows and multiply it with torch.
GGUF_MAX_ROWS = 8
# The block types ``gguf_int8.c`` multiplies by an int8-rounded x, and its x block.
INT8_TYPES = {BLOCK_TYPES[name] for name in ("Q4_0", "Q8_0", "Q4_K", "Q6_K")}
INT8_X_BLOCK = 32

_POINTER = ctypes.c_void_p
_INT = ctypes.c_int64


# What both linear kernels take: type, x, rows, k, blocks, n, row bytes, bias, y, threads.
_LINEAR_ARGUMENTS = (
    ctypes.c_int,
    _POINTER,
    _INT,
    _INT,
    _POINTER,
    _INT,
    _INT,
    _POINTER,
    _POINTER,
    ctypes.c_int,
)


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
    lib.gguf_linear.argtypes = _LINEAR_ARGUMENTS
    return lib


@cache
def _int8_library() -> ctypes.CDLL:
    lib = load("gguf_int8")
    lib.gguf_linear_int8.restype = lib.gguf_round_x.restype = None
    lib.gguf_linear_int8.argtypes = _LINEAR_ARGUMENTS
    lib.gguf_round_x.argtypes = [_POINTER, _INT, _POINTER, _POINTER, _POINTER, _POINTER]
    return lib


@cache
def int8_kernel_builds() -> bool:
    """Whether ``gguf_int8.c`` builds here (it needs AVX2)."""
    try:
        _int8_library()
    except RuntimeError:
        return False
    return True


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
    kernel = _library(march).gguf_linear
    return _blocks_launch("gguf_linear", kernel, GGUF_MAX_ROWS, x, blocks, bias, block_type, k, out)


def _blocks_launch(
    op: str,
    kernel: Callable[..., None],
    max_rows: int,
    x: torch.Tensor,
    blocks: torch.Tensor,
    bias: torch.Tensor | None,
    block_type: int,
    k: int,
    out: tuple[torch.Tensor, ...] | None,
) -> Launch:
    """The call of a linear kernel over blocks (both take the same arguments)."""
    row_bytes = _check(blocks, block_type, k)
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise TypeError(f"updraft::{op} takes float32 x [rows, {k}]")
    if x.shape[0] > max_rows:
        raise TypeError(f"updraft::{op} takes at most {max_rows} rows")
    given = (x, bias)
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    n = blocks.shape[0]
    (y,) = out or (x.new_empty(x.shape[0], n),)
    if not writable_output(y, (x.shape[0], n)):
        raise TypeError(f"updraft::{op} writes a contiguous float32 output")
    return Launch(
        kernel,
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
        reads_copies(given, (x, bias)),
    )


def gguf_round_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [k] float32 as ``gguf_linear_int8`` rounds it: (codes [k] int8, scales [k / 32]),
    x ~ codes * scale per block of 32."""
    k = x.shape[0]
    x = x.contiguous()
    codes = torch.empty(k, dtype=torch.int8)
    scales = torch.empty(k // INT8_X_BLOCK)
    sums = torch.empty(k // INT8_X_BLOCK)
    sums4 = torch.empty(k // 4, dtype=torch.int32)
    _int8_library().gguf_round_x(
        x.data_ptr(), k, codes.data_ptr(), scales.data_ptr(), sums4.data_ptr(), sums.data_ptr()
    )
    return codes, scales


def gguf_linear_int8(
    x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, block_type: int, k: int
) -> torch.Tensor:
    """x [1, k] float32, rounded to int8 in blocks of 32 (``gguf_round_x``), @ the weight
    in ``blocks`` [N, row_bytes] transposed (+ bias) -> [1, N]; ``block_type`` one of
    ``INT8_TYPES``."""
    return gguf_linear_int8_launch(x, blocks, bias, block_type, k)()[0]


def gguf_linear_int8_launch(
    x: torch.Tensor,
    blocks: torch.Tensor,
    bias: torch.Tensor | None,
    block_type: int,
    k: int,
    out: tuple[torch.Tensor, ...] | None = None,
) -> Launch:
    """``gguf_linear_int8``'s checked call, into ``out`` (else a new tensor)."""
    if block_type not in INT8_TYPES:
        raise TypeError(f"updraft::gguf_linear_int8 takes ggml block types {sorted(INT8_TYPES)}")
    kernel = _int8_library().gguf_linear_int8
    return _blocks_launch("gguf_linear_int8", kernel, 1, x, blocks, bias, block_type, k, out)


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
_FRAGMENT.define(
    "gguf_linear_int8(Tensor x, Tensor blocks, Tensor? bias, int block_type, int k) -> Tensor"
)
_FRAGMENT.impl("gguf_linear_int8", gguf_linear_int8, "CPU")
_FRAGMENT.impl(
    "gguf_linear_int8",
    lambda x, blocks, bias, block_type, k: x.new_empty(x.shape[0], blocks.shape[0]),
    "Meta",
)
