"""The C kernels as torch ops (``torch.ops.updraft.*``), with shape-only Meta versions.

A torch op, unlike a plain Python call, is seen by the dispatcher: graph capture
records it with its tensors and replays it like any aten op.
"""

from __future__ import annotations

import ctypes

import torch

from updraft.kernels.build import load

_POINTER = ctypes.c_void_p
_INT = ctypes.c_int64


def _int8_library() -> ctypes.CDLL:
    lib = load("int8_linear")
    lib.int8_linear.restype = None
    lib.int8_linear.argtypes = [_POINTER] * 5 + [_INT] * 3 + [ctypes.c_int]
    return lib


def _attention_library() -> ctypes.CDLL:
    lib = load("paged_attention")
    lib.paged_decode_attention.restype = None
    lib.paged_decode_attention.argtypes = (
        [_POINTER] * 6 + [_INT] * 7 + [ctypes.c_float, ctypes.c_int]
    )
    return lib


def _check(condition: bool, op: str, what: str) -> None:
    if not condition:
        raise TypeError(f"updraft::{op} takes {what}")


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] float32 @ (weight [N, K] int8 * scale [N] float32)^T + bias -> [M, N]."""
    _check(
        x.dtype == torch.float32 and weight.dtype == torch.int8 and x.device.type == "cpu",
        "int8_linear",
        "float32 activations and int8 weights on the CPU",
    )
    _check(weight.is_contiguous() and scale.is_contiguous(), "int8_linear", "contiguous weights")
    x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    _check(weight.shape[1] == k and scale.shape == (n,), "int8_linear", "matching shapes")
    out = torch.empty(rows, n, dtype=torch.float32)
    _int8_library().int8_linear(
        x.data_ptr(),
        weight.data_ptr(),
        scale.data_ptr(),
        None if bias is None else bias.contiguous().data_ptr(),
        out.data_ptr(),
        rows,
        n,
        k,
        torch.get_num_threads(),
    )
    return out


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """query [B, H, D] (one token per request), kv_cache [2, slots, Hkv, D], block_table
    [B, max_blocks] and seq_lens [B] int64 -> [B, H, D]."""
    _check(
        query.dtype == kv_cache.dtype == torch.float32 and query.device.type == "cpu",
        "paged_decode_attention",
        "float32 tensors on the CPU",
    )
    _check(
        block_table.dtype == seq_lens.dtype == torch.int64 and kv_cache.is_contiguous(),
        "paged_decode_attention",
        "int64 block tables and seq_lens and a contiguous cache",
    )
    requests, heads, head_dim = query.shape
    _, num_slots, kv_heads, _ = kv_cache.shape
    _check(
        heads % kv_heads == 0 and block_table.shape[0] == seq_lens.shape[0] == requests,
        "paged_decode_attention",
        "whole query-head groups and one block-table row and seq_len per request",
    )
    query = query.contiguous()
    block_table = block_table.contiguous()
    seq_lens = seq_lens.contiguous()
    out = torch.empty_like(query)
    _attention_library().paged_decode_attention(
        query.data_ptr(),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        block_table.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        requests,
        heads,
        kv_heads,
        head_dim,
        block_table.shape[1],
        block_size,
        num_slots,
        scale,
        torch.get_num_threads(),
    )
    return out


_LIBRARY = torch.library.Library("updraft", "DEF")
_LIBRARY.define("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor")
_LIBRARY.impl("int8_linear", int8_linear, "CPU")
_LIBRARY.impl(
    "int8_linear", lambda x, weight, scale, bias: x.new_empty(x.shape[0], weight.shape[0]), "Meta"
)
_LIBRARY.define(
    "paged_decode_attention(Tensor query, Tensor kv_cache, Tensor block_table, "
    "Tensor seq_lens, int block_size, float scale) -> Tensor"
)
_LIBRARY.impl("paged_decode_attention", paged_decode_attention, "CPU")
_LIBRARY.impl("paged_decode_attention", lambda query, *rest: torch.empty_like(query), "Meta")


def build_int8_linear() -> None:
    """Build the int8 kernel now, so a compiler problem shows at load, not mid-step."""
    _int8_library()


def paged_decode_attention_available() -> bool:
    """Whether the decode-attention kernel builds here (a C compiler is on PATH)."""
    try:
        _attention_library()
    except RuntimeError:
        return False
    return True
