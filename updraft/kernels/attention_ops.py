"""Decode attention over the paged KV cache, read in place, and the one-call write of
a step's keys and values into it, as torch ops (``torch.ops.updraft.*``). A GQA cache
is float32, or int8 rows of codes and their float32 scale (``attention/kv_int8.py``),
which the same two ops write and read."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache

import torch

from updraft.kernels.build import kernel_builds, load
from updraft.kernels.launch import (
    INT,
    POINTER,
    Launch,
    check,
    define_op,
    pointer,
    reads_copies,
    writable_output,
)

# An int8 cache row's scale, a float32 after its codes.
INT8_SCALE_BYTES = 4


@cache
def _attention_library(march: str = "native") -> ctypes.CDLL:
    lib = load("paged_attention", march)
    for kernel in (lib.paged_decode_attention, lib.paged_decode_attention_int8):
        kernel.restype = None
        kernel.argtypes = [POINTER] * 8 + [INT] * 10 + [ctypes.c_float, ctypes.c_int]
    lib.write_kv.restype = None
    lib.write_kv.argtypes = [POINTER, INT, INT, POINTER, INT, POINTER, INT, POINTER, INT]
    lib.write_kv_int8.restype = None
    lib.write_kv_int8.argtypes = [POINTER, INT, INT, INT, POINTER, INT, POINTER, INT, POINTER, INT]
    return lib


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    with_lse: bool = False,
    starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [B, H, D] (one token per request), kv_cache [2, slots, Hkv, D] (float32, or
    int8 [2, slots, Hkv, D + 4]: codes and a scale per head row), block_table
    [B, max_blocks] and seq_lens [B] int64 -> (out [B, H, D], lse). With ``with_lse``,
    lse [B, H] is each head's log-sum-exp of its scaled scores (-1e30 where the context
    is empty), what decode context parallelism merges shards by; else it is empty. With
    ``starts`` [B] int64, request b reads positions [starts[b], seq_lens[b]) only (a
    sliding window): earlier blocks are never touched, so they may have been freed."""
    launch = paged_decode_attention_launch(
        query, kv_cache, block_table, seq_lens, block_size, scale, with_lse, starts
    )
    return launch()


def paged_decode_attention_launch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    with_lse: bool = False,
    starts: torch.Tensor | None = None,
    out: tuple[torch.Tensor, ...] | None = None,
    march: str = "native",
) -> Launch:
    """``paged_decode_attention``'s checked call, into ``out`` (else new tensors);
    ``march``: the build to run (another than the machine's: a test of the narrower
    paths)."""
    op = "paged_decode_attention"
    check(kv_cache.is_contiguous(), op, "a contiguous cache")
    _, num_slots, kv_heads, row = kv_cache.shape
    quantized = kv_cache.dtype == torch.int8
    head_dim = row - INT8_SCALE_BYTES if quantized else row
    library = _attention_library(march)
    return _decode_attention(
        op,
        library.paged_decode_attention_int8 if quantized else library.paged_decode_attention,
        query,
        (kv_cache[0], kv_cache[1]),
        (num_slots, kv_heads, head_dim, head_dim, row, kv_heads * row),
        block_table,
        seq_lens,
        block_size,
        scale,
        with_lse,
        starts,
        out,
    )


def writes_kv_in_one_call(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``write_kv`` takes these: a contiguous CPU cache [2, slots, heads, dim],
    and keys and values of its dtype whose rows are [heads, dim] laid out as the cache's
    (rows may be strided: views of a fused projection's output); or an int8 cache
    [2, slots, heads, dim + 4] and float32 keys and values whose rows are [heads, dim]
    one after the other, which it quantizes as it writes them."""
    if not (
        kv_cache.device.type == "cpu"
        and kv_cache.dim() == 4
        and kv_cache.shape[1] > 0  # the kernel takes slots modulo their number
        and kv_cache.is_contiguous()
        and kernel_builds("paged_attention")
    ):
        return False
    heads, row = kv_cache.shape[2:]
    if kv_cache.dtype == torch.int8:
        dim = row - INT8_SCALE_BYTES
        dtype, shape, strides = torch.float32, (heads, dim), (dim, 1)
    else:
        dtype, shape, strides = kv_cache.dtype, (heads, row), kv_cache.stride()[2:]
    return all(
        t.dtype == dtype
        and t.device == kv_cache.device
        and t.dim() == 3
        and t.shape[1:] == shape
        and t.stride()[1:] == strides
        for t in (key, value)
    )


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """In place: key[i] and value[i] [heads, dim] into slot ``slot_mapping[i]`` (modulo
    the slots, so -1 is the spare last one) of the key and value halves of ``kv_cache``
    [2, slots, heads, dim]; one C call for both (``writes_kv_in_one_call`` says which
    tensors it takes)."""
    write_kv_launch(kv_cache, key, value, slot_mapping)()


def write_kv_launch(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    out: tuple[torch.Tensor, ...] | None = None,
    march: str = "native",
) -> Launch:
    """``write_kv``'s checked call (``out``, for the bound-call registry, is unused: the
    op writes the cache it is given; ``march`` as ``paged_decode_attention_launch``'s)."""
    op = "write_kv"
    check(writes_kv_in_one_call(kv_cache, key, value), op, "keys and values shaped as the cache")
    check(
        slot_mapping.dtype == torch.int64
        and slot_mapping.device.type == "cpu"
        and slot_mapping.dim() == 1
        and slot_mapping.shape[0] == key.shape[0] == value.shape[0],
        op,
        "an int64 slot per key and value row",
    )
    given = slot_mapping
    slot_mapping = slot_mapping.contiguous()
    if kv_cache.dtype == torch.int8:
        return _write_kv_int8_launch(kv_cache, key, value, slot_mapping, given, march)
    size = kv_cache.element_size()
    return Launch(
        _attention_library(march).write_kv,
        (
            kv_cache.data_ptr(),
            kv_cache.shape[1],
            kv_cache.stride(1) * size,
            key.data_ptr(),
            key.stride(0) * size,
            value.data_ptr(),
            value.stride(0) * size,
            slot_mapping.data_ptr(),
            key.shape[0],
        ),
        (kv_cache,),
        (kv_cache, key, value, slot_mapping),
        slot_mapping is not given,
    )


def _write_kv_int8_launch(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    given: torch.Tensor,
    march: str,
) -> Launch:
    """``write_kv`` into an int8 cache: each head row quantized as it is written."""
    _, slots, heads, row = kv_cache.shape
    arguments = (
        kv_cache.data_ptr(),
        slots,
        heads,
        row - INT8_SCALE_BYTES,
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        slot_mapping.data_ptr(),
        key.shape[0],
    )
    return Launch(
        _attention_library(march).write_kv_int8,
        arguments,
        (kv_cache,),
        (kv_cache, key, value, slot_mapping),
        slot_mapping is not given,
    )


def paged_latent_attention(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    value_dim: int,
    with_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-query attention over a latent cache [slots, C]: query [B, H, W] scores the
    first W columns of each context row, and the first ``value_dim`` columns are the
    values -> (out [B, H, value_dim], lse as ``paged_decode_attention``'s)."""
    op = "paged_latent_attention"
    num_slots, width = latent_cache.shape
    check(
        latent_cache.is_contiguous()
        and latent_cache.dtype == torch.float32
        and query.shape[-1] <= width
        and value_dim <= width,
        op,
        "a contiguous float32 [slots, C] cache at least as wide as the query and the values",
    )
    return _decode_attention(
        op,
        _attention_library().paged_decode_attention,
        query,
        (latent_cache, latent_cache),
        (num_slots, 1, query.shape[-1], value_dim, query.shape[-1], width),
        block_table,
        seq_lens,
        block_size,
        scale,
        with_lse,
    )()


def _decode_attention(
    op: str,
    kernel: Callable[..., None],
    query: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    # slots, kv heads, key dim, value dim, and the elements from a head's row to the
    # next head's and from a slot to the next
    geometry: tuple[int, int, int, int, int, int],
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    with_lse: bool,
    starts: torch.Tensor | None = None,
    out: tuple[torch.Tensor, ...] | None = None,
) -> Launch:
    num_slots, kv_heads, head_dim, value_dim, head_stride, slot_stride = geometry
    _check_decode_inputs(op, query, caches[0], kv_heads, head_dim, block_table, seq_lens, starts)
    requests, heads, _ = query.shape
    given = (query, block_table, seq_lens, starts)
    query = query.contiguous()
    block_table = block_table.contiguous()
    seq_lens = seq_lens.contiguous()
    starts = None if starts is None else starts.contiguous()
    result, lse = out or (
        query.new_empty(requests, heads, value_dim),
        query.new_empty((requests, heads) if with_lse else (0,)),
    )
    check(
        writable_output(result, (requests, heads, value_dim))
        and writable_output(lse, (requests, heads) if with_lse else (0,)),
        op,
        "contiguous float32 outputs",
    )
    return Launch(
        kernel,
        (
            query.data_ptr(),
            caches[0].data_ptr(),
            caches[1].data_ptr(),
            block_table.data_ptr(),
            seq_lens.data_ptr(),
            pointer(starts),
            result.data_ptr(),
            lse.data_ptr() if with_lse else None,
            requests,
            heads,
            kv_heads,
            head_dim,
            value_dim,
            head_stride,
            slot_stride,
            block_table.shape[1],
            block_size,
            num_slots,
            scale,
            0,  # OpenMP's count when it runs (the engine lowers it under contention)
        ),
        (result, lse),
        (query, *caches, block_table, seq_lens, starts),
        reads_copies(given, (query, block_table, seq_lens, starts)),
    )


def _check_decode_inputs(
    op: str,
    query: torch.Tensor,
    cache: torch.Tensor,
    kv_heads: int,
    head_dim: int,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    starts: torch.Tensor | None,
) -> None:
    check(
        query.dtype == torch.float32
        and cache.dtype in (torch.float32, torch.int8)
        and query.device.type == "cpu"
        and cache.device.type == "cpu",
        op,
        "float32 tensors on the CPU (the cache float32 or int8)",
    )
    check(
        block_table.dtype == seq_lens.dtype == torch.int64
        and (starts is None or (starts.dtype == torch.int64 and starts.shape == seq_lens.shape)),
        op,
        "int64 block tables and seq_lens (and starts, one per request)",
    )
    requests, heads, query_dim = query.shape
    check(
        query_dim == head_dim
        and heads % kv_heads == 0
        and block_table.shape[0] == seq_lens.shape[0] == requests,
        op,
        "whole query-head groups and one block-table row and seq_len per request",
    )


def _attention_meta(
    query: torch.Tensor, value_dim: int, with_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shapes of a decode-attention op's results."""
    lse = query.new_empty((*query.shape[:2],) if with_lse else (0,))
    return query.new_empty(*query.shape[:2], value_dim), lse


def _gqa_meta(query, cache, table, lens, block_size, scale, with_lse=False, starts=None):
    return _attention_meta(query, query.shape[-1], with_lse)


def _latent_meta(query, cache, table, lens, block_size, scale, value_dim, with_lse=False):
    return _attention_meta(query, value_dim, with_lse)


define_op(
    "paged_decode_attention(Tensor query, Tensor kv_cache, Tensor block_table, "
    "Tensor seq_lens, int block_size, float scale, bool with_lse=False, Tensor? starts=None) "
    "-> (Tensor, Tensor)",
    paged_decode_attention,
    _gqa_meta,
)
define_op(
    "paged_latent_attention(Tensor query, Tensor latent_cache, Tensor block_table, "
    "Tensor seq_lens, int block_size, float scale, int value_dim, bool with_lse=False) "
    "-> (Tensor, Tensor)",
    paged_latent_attention,
    _latent_meta,
)
define_op(
    "write_kv(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()",
    write_kv,
    lambda kv_cache, key, value, slot_mapping: None,
)
