"""GGUF's quantized blocks as torch ops over ``kernels/gguf_blocks.c``:
``updraft::gguf_linear`` (a few rows of x against a weight in blocks, widened in
registers) and ``updraft::gguf_dequantize`` (rows of blocks to float32: an embedding's
looked-up rows, a prefill's chunk of weight rows, and tests).

A weight is a uint8 tensor [N, row_bytes], each row K / B blocks as the file holds them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from functools import cache

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from updraft.checkpoints import gguf as gguf_file
from updraft.kernels.build import load
from updraft.kernels.huge_pages import huge_page_empty
from updraft.kernels.int8_groups import UPDRAFT_BLOCKS
from updraft.kernels.launch import INT, POINTER, Launch, define_op, reads_copies, writable_output

# ggml's type numbers of the block types read here, and (values, bytes) per block, as
# the gguf package has them (the kernel's own switch must agree: tests/test_gguf.py).
BLOCK_TYPES = {name: GGMLQuantizationType[name].value for name in gguf_file.BLOCK_TYPES}
BLOCKS = {code: GGML_QUANT_SIZES[GGMLQuantizationType(code)] for code in BLOCK_TYPES.values()}
# Up to this many rows of x the kernel runs (its partial sums live in registers and
# the stack); more rows widen a chunk of weight rows and multiply it with torch.
GGUF_MAX_ROWS = 8
# Up to this many rows of x, passes of the block kernel over the weight (one per 8 rows)
# cost less than widening the whole weight to float32 and reading that back.
BLOCK_PASSES_UP_TO = 64
# The block types ``gguf_int8.c`` multiplies by x rounded to int8 in blocks of
# INT8_X_BLOCK, up to INT8_MAX_ROWS rows of it, over weight rows regrouped eight at a time.
INT8_TYPES = {BLOCK_TYPES[name] for name in ("Q4_0", "Q8_0", "Q4_K", "Q6_K")}
INT8_TYPES |= {BLOCK_TYPES[name] for name in ("Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4")}
INT8_TYPES |= {BLOCK_TYPES[name] for name in ("Q2_K", "Q3_K", "Q5_K", "IQ4_XS")}
INT8_X_BLOCK = 32
# What the int8 kernel regroups and multiplies, by type code: those of ggml's block types
# and updraft's own int8 and int4 codes in blocks (``kernels/int8_groups.py``).
GROUPED_BLOCKS = {**{code: BLOCKS[code] for code in INT8_TYPES}, **UPDRAFT_BLOCKS}
INT8_MAX_ROWS = 8
GROUP_ROWS = 8


# What both linear kernels take: type, x, rows, k, blocks, n, row bytes, bias, y, threads.
_LINEAR_ARGUMENTS = (
    ctypes.c_int,
    POINTER,
    INT,
    INT,
    POINTER,
    INT,
    INT,
    POINTER,
    POINTER,
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
        POINTER,
        INT,
        INT,
        INT,
        POINTER,
        ctypes.c_int,
    ]
    lib.gguf_linear.restype = None
    lib.gguf_linear.argtypes = _LINEAR_ARGUMENTS
    lib.gguf_grouped_rows.restype = None
    lib.gguf_grouped_rows.argtypes = [
        POINTER,  # x
        INT,  # hidden
        INT,  # inter
        POINTER,  # offsets
        INT,  # experts
        INT,  # most rows
        ctypes.c_int,  # parts
        POINTER,  # gate_up[0]
        ctypes.c_int,
        POINTER,  # gate_up[1]
        ctypes.c_int,
        POINTER,  # gate_up bias
        POINTER,  # down
        ctypes.c_int,
        POINTER,  # down bias
        ctypes.c_int,  # activation
        ctypes.c_float,  # alpha
        ctypes.c_float,  # limit
        POINTER,  # scratch
        POINTER,  # out
        ctypes.c_int,  # threads
    ]
    return lib


def gguf_grouped_rows(
    x: torch.Tensor,
    offsets: torch.Tensor,
    gate_up: list[torch.Tensor],
    gate_up_types: list[int],
    down: torch.Tensor,
    down_type: int,
    inter: int,
    biases: tuple[torch.Tensor | None, torch.Tensor | None],
    activation: tuple[int, float, float],
    out: torch.Tensor,
) -> None:
    """The experts of ``gguf_grouped_mlp`` that hold at most ``BLOCK_PASSES_UP_TO`` rows,
    in one call of the C kernel (per expert: gate and up, the activation, down, into
    their rows of ``out``). The caller has checked the tensors; ``activation``: its
    ``EXPERT_ACTIVATIONS`` index, alpha and limit (gpt-oss's; unused otherwise)."""
    gate_up = [part.contiguous() for part in gate_up]
    second = gate_up[1] if len(gate_up) == 2 else gate_up[0]
    gate_up_bias, down_bias = (None if b is None else b.contiguous() for b in biases)
    scratch = torch.empty(GGUF_MAX_ROWS * 3 * inter)
    index, alpha, limit = activation
    _library().gguf_grouped_rows(
        x.data_ptr(),
        x.shape[1],
        inter,
        offsets.data_ptr(),
        down.shape[0],
        BLOCK_PASSES_UP_TO,
        len(gate_up),
        gate_up[0].data_ptr(),
        gate_up_types[0],
        second.data_ptr(),
        gate_up_types[-1],
        None if gate_up_bias is None else gate_up_bias.data_ptr(),
        down.contiguous().data_ptr(),
        down_type,
        None if down_bias is None else down_bias.data_ptr(),
        index,
        alpha,
        limit,
        scratch.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )


@cache
def _int8_library(march: str = "native") -> ctypes.CDLL:
    """``gguf_int8.c`` built for ``march`` (``haswell``: AVX2 without VNNI; ``x86-64``:
    the portable C path)."""
    lib = load("gguf_int8", march)
    for name in (
        "gguf_linear_int8",
        "gguf_gemm_int8",
        "gguf_round_x",
        "gguf_round_rows",
        "gguf_group",
    ):
        getattr(lib, name).restype = None
    lib.gguf_ungroup.restype = ctypes.c_int
    lib.gguf_linear_int8.argtypes = _LINEAR_ARGUMENTS
    lib.gguf_gemm_int8.argtypes = _LINEAR_ARGUMENTS
    lib.gguf_round_x.argtypes = [POINTER, INT, POINTER, POINTER, POINTER, POINTER, POINTER]
    lib.gguf_round_rows.argtypes = [POINTER, INT, INT, POINTER]
    lib.gguf_group.argtypes = [ctypes.c_int, POINTER, INT, INT, POINTER]
    lib.gguf_ungroup.argtypes = [ctypes.c_int, POINTER, INT, INT, POINTER, INT, POINTER]
    lib.gguf_group_block_bytes.restype = INT
    lib.gguf_group_block_bytes.argtypes = [ctypes.c_int]
    lib.gguf_int8_simd.restype = ctypes.c_int
    lib.gguf_int8_simd.argtypes = []
    lib.gguf_int8_unpack.restype = None
    lib.gguf_int8_unpack.argtypes = [ctypes.c_int, POINTER, ctypes.c_int, POINTER, POINTER, POINTER]
    return lib


@cache
def int8_kernel_builds() -> bool:
    """Whether ``gguf_int8.c`` builds here (it does wherever a C compiler is: without
    AVX2 its portable path; ``int8_simd_builds`` says whether it is the fast one)."""
    try:
        _int8_library()
    except RuntimeError:
        return False
    return True


def int8_simd_level(march: str = "native") -> int:
    """How ``gguf_int8.c`` built for ``march`` multiplies bytes: 2 with VNNI (vpdpbusd),
    1 with AVX2 alone, 0 in portable C (several times slower)."""
    return _int8_library(march).gguf_int8_simd()


@cache
def int8_simd_builds() -> bool:
    """Whether this machine's ``gguf_int8.c`` has SIMD kernels (AVX2, F16C and FMA):
    where it has not, int8 activations are computed, exactly, by a slow portable path."""
    return int8_kernel_builds() and int8_simd_level() > 0


def gguf_int8_unpack(
    groups: torch.Tensor, block_type: int, block: int, r: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row ``r`` of group-block ``block`` (counted over the whole of ``groups``) as the
    portable kernel reads it: (codes [B] int8, scale [B / 16], min [B / 16]), value i =
    scale[i // 16] * codes[i] + min[i // 16] exactly."""
    if block_type not in INT8_TYPES or not 0 <= r < GROUP_ROWS:
        raise TypeError(f"updraft::gguf_int8_unpack takes types {sorted(INT8_TYPES)}, rows 0..7")
    values = BLOCKS[block_type][0]
    size = _int8_library().gguf_group_block_bytes(block_type)
    if (
        groups.dtype != torch.uint8
        or not groups.is_contiguous()
        or groups.numel() < (block + 1) * size
    ):
        raise TypeError(f"updraft::gguf_int8_unpack: no group-block {block} in these groups")
    codes = torch.empty(values, dtype=torch.int8)
    scale, low = torch.empty(values // 16), torch.empty(values // 16)
    _int8_library().gguf_int8_unpack(
        block_type,
        groups.data_ptr() + block * size,
        r,
        codes.data_ptr(),
        scale.data_ptr(),
        low.data_ptr(),
    )
    return codes, scale, low


def gguf_kernel_builds() -> bool:
    try:
        _library()
    except RuntimeError:
        return False
    return True


def _check(
    blocks: torch.Tensor, block_type: int, k: int, types: dict[int, tuple[int, int]] = BLOCKS
) -> int:
    """Bytes of one row of ``blocks``; refuses what the kernel cannot read (``types``:
    what it reads, by code)."""
    if block_type not in types:
        raise TypeError(f"updraft::gguf ops take block types {sorted(types)}")
    values, size = types[block_type]
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
    row_bytes = _check(blocks, block_type, k)
    n = blocks.shape[0]
    return _linear_launch(
        "gguf_linear", kernel, GGUF_MAX_ROWS, x, blocks, n, row_bytes, bias, block_type, k, out
    )


def _linear_launch(
    op: str,
    kernel: Callable[..., None],
    max_rows: int | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    n: int,
    stride: int,
    bias: torch.Tensor | None,
    block_type: int,
    k: int,
    out: tuple[torch.Tensor, ...] | None,
    threads: int = 0,
) -> Launch:
    """The call of a linear kernel over a weight's ``n`` rows, in blocks or groups
    ``stride`` bytes apart (the kernels take the same arguments), ``max_rows`` rows of x
    at most (None: any number, each row's output its own, so that a replayed graph may
    run it over its leading rows alone), on ``threads`` threads (0: torch's count when
    it runs, not when a graph bound it)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise TypeError(f"updraft::{op} takes float32 x [rows, {k}]")
    if max_rows is not None and x.shape[0] > max_rows:
        raise TypeError(f"updraft::{op} takes at most {max_rows} rows")
    given = (x, bias)
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    if bias is not None and bias.shape != (n,):
        raise TypeError(f"updraft::{op} takes a bias of {n} values")
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
            weight.data_ptr(),
            n,
            stride,
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            threads,
        ),
        (y,),
        (x, weight, bias),
        reads_copies(given, (x, bias)),
        rows_argument=None if max_rows is not None else 2,
    )


def gguf_round_x(x: torch.Tensor, march: str = "native") -> tuple[torch.Tensor, torch.Tensor]:
    """x [k] float32 as ``gguf_linear_int8`` rounds it: (codes [k] int8, scales [k / 32]),
    x ~ codes * scale per block of 32 (the same in every build)."""
    k = x.shape[0]
    x = x.contiguous()
    codes = torch.empty(k, dtype=torch.int8)
    scales = torch.empty(k // INT8_X_BLOCK)
    offsets16 = torch.empty(k // 16, dtype=torch.int32)
    sums32 = torch.empty(k // 32, dtype=torch.int32)
    sums16 = torch.empty(k // 16, dtype=torch.int32)
    _int8_library(march).gguf_round_x(
        x.data_ptr(),
        k,
        codes.data_ptr(),
        scales.data_ptr(),
        offsets16.data_ptr(),
        sums32.data_ptr(),
        sums16.data_ptr(),
    )
    return codes, scales


def gguf_round_rows(x: torch.Tensor, march: str = "native") -> torch.Tensor:
    """x [M, k] float32 -> each row as ``gguf_linear_int8`` rounds it, in float32
    (codes times their block's scale)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] % INT8_X_BLOCK:
        raise TypeError(
            f"updraft::gguf_round_rows takes float32 x [rows, k], k % {INT8_X_BLOCK} == 0"
        )
    x = x.contiguous()
    out = torch.empty_like(x)
    _int8_library(march).gguf_round_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


def _group_bytes(block_type: int, k: int) -> int:
    """Bytes of one group of eight rows of ``k`` values in ``block_type``."""
    return k // GROUPED_BLOCKS[block_type][0] * _int8_library().gguf_group_block_bytes(block_type)


def _check_groups(groups: torch.Tensor, block_type: int, k: int, n: int) -> int:
    """Bytes of one group of ``groups`` (``n`` rows of ``k`` values); refuses the rest."""
    if block_type not in GROUPED_BLOCKS:
        raise TypeError(f"updraft::gguf groups are of block types {sorted(GROUPED_BLOCKS)}")
    values = GROUPED_BLOCKS[block_type][0]
    if groups.dtype != torch.uint8 or groups.dim() != 2 or not groups.is_contiguous():
        raise TypeError("updraft::gguf ops take contiguous uint8 groups [groups, group_bytes]")
    group_bytes = _group_bytes(block_type, k)
    if k % values or groups.shape[1] != group_bytes:
        raise TypeError(
            f"groups of {groups.shape[1]} bytes are not {k} values in blocks of {values}"
        )
    if groups.shape[0] != -(-n // GROUP_ROWS):
        raise TypeError(f"{groups.shape[0]} groups do not hold {n} rows")
    return group_bytes


def gguf_group(
    blocks: torch.Tensor | Sequence[torch.Tensor], block_type: int, k: int
) -> torch.Tensor:
    """A weight's rows [N, row_bytes] in the file's blocks (or the rows of each of its
    parts in turn, a fused weight's) -> the same codes and scales regrouped eight rows
    at a time [ceil(N / 8), group_bytes] (``gguf_int8.c``). Parts of whole groups are
    each regrouped into their own groups, with no joined copy of their rows."""
    parts = [blocks] if isinstance(blocks, torch.Tensor) else list(blocks)
    if any(part.shape[0] % GROUP_ROWS for part in parts[:-1]):
        parts = [torch.cat(parts)]  # a group would hold rows of two parts
    n = sum(part.shape[0] for part in parts)
    groups = huge_page_empty(-(-n // GROUP_ROWS), _group_bytes(block_type, k))
    first = 0
    for part in parts:
        _check(part, block_type, k, GROUPED_BLOCKS)
        out = groups[first // GROUP_ROWS].data_ptr() if part.shape[0] else groups.data_ptr()
        _int8_library().gguf_group(block_type, part.data_ptr(), part.shape[0], k, out)
        first += part.shape[0]
    return groups


def gguf_ungroup(
    groups: torch.Tensor, block_type: int, k: int, n: int, rows: torch.Tensor
) -> torch.Tensor:
    """Rows ``rows`` (int64) of the ``n``-row weight in ``groups``, in the file's bytes."""
    _check_groups(groups, block_type, k, n)
    rows = rows.to(torch.int64).contiguous()
    values, size = GROUPED_BLOCKS[block_type]
    out = torch.empty(rows.numel(), k // values * size, dtype=torch.uint8)
    read = _int8_library().gguf_ungroup(
        block_type, groups.data_ptr(), n, k, rows.data_ptr(), rows.numel(), out.data_ptr()
    )
    if read != 0:
        raise IndexError(f"updraft::gguf_ungroup: a row outside 0..{n - 1}")
    return out


def gguf_dequantize_groups(
    groups: torch.Tensor, block_type: int, k: int, n: int, rows: torch.Tensor
) -> torch.Tensor:
    """Rows ``rows`` of the weight in ``groups``, widened to float32 [len(rows), k]: a
    tied embedding's looked-up rows."""
    return gguf_dequantize(gguf_ungroup(groups, block_type, k, n, rows), block_type, k)


def gguf_linear_int8(
    x: torch.Tensor,
    groups: torch.Tensor,
    bias: torch.Tensor | None,
    block_type: int,
    k: int,
    n: int,
    march: str = "native",
) -> torch.Tensor:
    """x [M, k] float32 (M <= INT8_MAX_ROWS), each row rounded to int8 as
    ``gguf_round_x`` rounds it, @ the ``n``-row weight in ``groups`` transposed (+ bias)
    -> [M, n]; ``block_type`` one of ``GROUPED_BLOCKS``; ``march`` the kernel's build."""
    return gguf_linear_int8_launch(x, groups, bias, block_type, k, n, march=march)()[0]


def gguf_linear_int8_launch(
    x: torch.Tensor,
    groups: torch.Tensor,
    bias: torch.Tensor | None,
    block_type: int,
    k: int,
    n: int,
    out: tuple[torch.Tensor, ...] | None = None,
    march: str = "native",
) -> Launch:
    """``gguf_linear_int8``'s checked call, into ``out`` (else a new tensor)."""
    group_bytes = _check_groups(groups, block_type, k, n)
    kernel = _int8_library(march).gguf_linear_int8
    arguments = (x, groups, n, group_bytes, bias, block_type, k, out)
    return _linear_launch("gguf_linear_int8", kernel, INT8_MAX_ROWS, *arguments)


def gguf_gemm_int8(
    x: torch.Tensor,
    groups: torch.Tensor,
    bias: torch.Tensor | None,
    block_type: int,
    k: int,
    n: int,
    march: str = "native",
) -> torch.Tensor:
    """``gguf_linear_int8`` for any number of rows of x (a prefill, a batched step): x
    rounded once, row by row as ``gguf_round_x`` rounds it, then each group of eight
    weight rows multiplied by every tile of x's rows while it is in the cache. Row for
    row the same sums as ``gguf_linear_int8``'s."""
    return gguf_gemm_int8_launch(x, groups, bias, block_type, k, n, march=march)()[0]


def gguf_gemm_int8_launch(
    x: torch.Tensor,
    groups: torch.Tensor,
    bias: torch.Tensor | None,
    block_type: int,
    k: int,
    n: int,
    out: tuple[torch.Tensor, ...] | None = None,
    march: str = "native",
) -> Launch:
    """``gguf_gemm_int8``'s checked call, into ``out`` (else a new tensor)."""
    group_bytes = _check_groups(groups, block_type, k, n)
    kernel = _int8_library(march).gguf_gemm_int8
    arguments = (x, groups, n, group_bytes, bias, block_type, k, out)
    return _linear_launch("gguf_gemm_int8", kernel, None, *arguments)


# Weight rows widened at once by ``gguf_widened_linear``: a few MB of float32.
WIDEN_ROWS = 1024


def gguf_widened_linear(
    x: torch.Tensor, blocks: torch.Tensor, block_type: int, k: int, n: int
) -> torch.Tensor:
    """x [M, k] float32 @ the ``n``-row weight in ``blocks`` transposed -> [M, n], for
    many rows of x (a prefill): a chunk of weight rows at a time is widened to float32
    and multiplied with torch. One op, so that a captured graph sees none of the widened
    chunks: recorded one by one, every chunk of every linear was alive at once while a
    graph was captured (the whole model in float32: 4.6 GB at load for a 0.5B Q4_K_M
    file, 1.3 GB without the prefill graphs)."""
    chunks = []
    for start in range(0, n, WIDEN_ROWS):
        widened = gguf_dequantize(blocks[start : start + WIDEN_ROWS], block_type, k)
        chunks.append(torch.mm(x, widened.t()))
        del widened
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)


define_op(
    "gguf_dequantize(Tensor blocks, int block_type, int k) -> Tensor",
    gguf_dequantize,
    lambda blocks, block_type, k: blocks.new_empty(blocks.shape[0], k, dtype=torch.float32),
)
define_op(
    "gguf_linear(Tensor x, Tensor blocks, Tensor? bias, int block_type, int k) -> Tensor",
    lambda x, blocks, bias, block_type, k: gguf_linear(x, blocks, bias, block_type, k),
    lambda x, blocks, bias, block_type, k: x.new_empty(x.shape[0], blocks.shape[0]),
)
define_op(
    "gguf_linear_int8(Tensor x, Tensor groups, Tensor? bias, int block_type, int k, int n) "
    "-> Tensor",
    lambda x, groups, bias, block_type, k, n: gguf_linear_int8(x, groups, bias, block_type, k, n),
    lambda x, groups, bias, block_type, k, n: x.new_empty(x.shape[0], n),
)
define_op(
    "gguf_dequantize_groups(Tensor groups, int block_type, int k, int n, Tensor rows) -> Tensor",
    gguf_dequantize_groups,
    lambda groups, block_type, k, n, rows: groups.new_empty(rows.numel(), k, dtype=torch.float32),
)
define_op(
    "gguf_gemm_int8(Tensor x, Tensor groups, Tensor? bias, int block_type, int k, int n) -> Tensor",
    lambda x, groups, bias, block_type, k, n: gguf_gemm_int8(x, groups, bias, block_type, k, n),
    lambda x, groups, bias, block_type, k, n: x.new_empty(x.shape[0], n),
)
define_op(
    "gguf_widened_linear(Tensor x, Tensor blocks, int block_type, int k, int n) -> Tensor",
    gguf_widened_linear,
    lambda x, blocks, block_type, k, n: x.new_empty(x.shape[0], n),
)
