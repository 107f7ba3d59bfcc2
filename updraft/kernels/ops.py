"""The C kernels as torch ops (``torch.ops.updraft.*``), with shape-only Meta versions.

A torch op, unlike a plain Python call, is seen by the dispatcher: graph capture
records it with its tensors and replays it like any aten op.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from updraft.kernels.build import load

_POINTER = ctypes.c_void_p
_INT = ctypes.c_int64


# Cached: ops call these on every step, and the argument types need setting only once.
@cache
def _linear_library() -> ctypes.CDLL:
    lib = load("linear")
    lib.int8_linear.restype = lib.float_linear.restype = None
    lib.int8_linear.argtypes = [_POINTER] * 5 + [_INT] * 3 + [ctypes.c_int]
    lib.float_linear.argtypes = [_POINTER] * 4 + [_INT] * 3 + [ctypes.c_int]
    return lib


@cache
def _moe_library() -> ctypes.CDLL:
    lib = load("moe")
    lib.grouped_mlp.restype = None
    lib.grouped_mlp.argtypes = [_POINTER] * 6 + [_INT] * 4 + [ctypes.c_int]
    return lib


@cache
def _attention_library() -> ctypes.CDLL:
    lib = load("paged_attention")
    lib.paged_decode_attention.restype = None
    lib.paged_decode_attention.argtypes = (
        [_POINTER] * 7 + [_INT] * 9 + [ctypes.c_float, ctypes.c_int]
    )
    return lib


def _check(condition: bool, op: str, what: str) -> None:
    if not condition:
        raise TypeError(f"updraft::{op} takes {what}")


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] float32 @ (weight [N, K] int8 * scale [N] float32)^T + bias -> [M, N]."""
    op = "int8_linear"
    _check(x.dtype == torch.float32 and x.device.type == "cpu", op, "float32 x on the CPU")
    _check(weight.dtype == torch.int8, op, "an int8 weight")
    _check(weight.is_contiguous(), op, "a contiguous weight")
    x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    _check(weight.shape[1] == k, op, f"a weight of {k} columns for x [{rows}, {k}]")
    _check(scale.shape == (n,), op, "one scale per output row")
    _check(bias is None or bias.shape == (n,), op, "one bias per output row")
    out = torch.empty(rows, n, dtype=torch.float32)
    _linear_library().int8_linear(
        x.data_ptr(),
        weight.data_ptr(),
        scale.contiguous().data_ptr(),
        None if bias is None else bias.float().contiguous().data_ptr(),
        out.data_ptr(),
        rows,
        n,
        k,
        torch.get_num_threads(),
    )
    return out


# Output rows per panel of a ``float_linear`` weight (``PANEL`` in linear.c).
PANEL = 16


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 -> its panels for ``float_linear``: [ceil(N / PANEL), K,
    PANEL], each panel the transpose of PANEL weight rows, zero past row N."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=torch.float32)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def float_linear(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias, all float32, for few rows of x; the weight as
    ``pack_panels`` lays it out, N = ``out_features``."""
    op = "float_linear"
    _check(x.dtype == torch.float32 and x.device.type == "cpu", op, "float32 x on the CPU")
    _check(panels.dtype == torch.float32 and panels.is_contiguous(), op, "packed panels")
    x = x.contiguous()
    rows, k = x.shape
    _check(
        panels.shape == (-(-out_features // PANEL), k, PANEL),
        op,
        f"the panels of a [{out_features}, {k}] weight for x [{rows}, {k}]",
    )
    _check(bias is None or bias.shape == (out_features,), op, "one bias per output row")
    out = torch.empty(rows, out_features, dtype=torch.float32)
    _linear_library().float_linear(
        x.data_ptr(),
        panels.data_ptr(),
        None if bias is None else bias.float().contiguous().data_ptr(),
        out.data_ptr(),
        rows,
        out_features,
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
    with_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [B, H, D] (one token per request), kv_cache [2, slots, Hkv, D], block_table
    [B, max_blocks] and seq_lens [B] int64 -> (out [B, H, D], lse). With ``with_lse``,
    lse [B, H] is each head's log-sum-exp of its scaled scores (-1e30 where the context
    is empty), what decode context parallelism merges shards by; else it is empty."""
    op = "paged_decode_attention"
    _check(kv_cache.is_contiguous(), op, "a contiguous cache")
    _, num_slots, kv_heads, head_dim = kv_cache.shape
    return _decode_attention(
        op,
        query,
        (kv_cache[0], kv_cache[1]),
        (num_slots, kv_heads, head_dim, head_dim, kv_heads * head_dim),
        block_table,
        seq_lens,
        block_size,
        scale,
        with_lse,
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
    _check(
        latent_cache.is_contiguous() and query.shape[-1] <= width and value_dim <= width,
        op,
        "a contiguous [slots, C] cache at least as wide as the query and the values",
    )
    return _decode_attention(
        op,
        query,
        (latent_cache, latent_cache),
        (num_slots, 1, query.shape[-1], value_dim, width),
        block_table,
        seq_lens,
        block_size,
        scale,
        with_lse,
    )


def _decode_attention(
    op: str,
    query: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    geometry: tuple[int, int, int, int, int],  # slots, kv heads, key dim, value dim, stride
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    with_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_slots, kv_heads, head_dim, value_dim, slot_stride = geometry
    _check(
        query.dtype == caches[0].dtype == torch.float32 and query.device.type == "cpu",
        op,
        "float32 tensors on the CPU",
    )
    _check(
        block_table.dtype == seq_lens.dtype == torch.int64,
        op,
        "int64 block tables and seq_lens",
    )
    requests, heads, query_dim = query.shape
    _check(
        query_dim == head_dim
        and heads % kv_heads == 0
        and block_table.shape[0] == seq_lens.shape[0] == requests,
        op,
        "whole query-head groups and one block-table row and seq_len per request",
    )
    query = query.contiguous()
    block_table = block_table.contiguous()
    seq_lens = seq_lens.contiguous()
    out = query.new_empty(requests, heads, value_dim)
    lse = query.new_empty((requests, heads) if with_lse else (0,))
    _attention_library().paged_decode_attention(
        query.data_ptr(),
        caches[0].data_ptr(),
        caches[1].data_ptr(),
        block_table.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        lse.data_ptr() if with_lse else None,
        requests,
        heads,
        kv_heads,
        head_dim,
        value_dim,
        slot_stride,
        block_table.shape[1],
        block_size,
        num_slots,
        scale,
        torch.get_num_threads(),
    )
    return out, lse


def grouped_mlp(
    x: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Rows of x [R, H] grouped by expert (rows [offsets[e], offsets[e+1]) to expert e)
    through each expert's SiLU MLP: gate_up [E, 2I, H], down [E, H, I] -> [R, H]."""
    experts, double_inter, hidden = gate_up.shape
    inter = double_inter // 2
    _check(
        x.dtype == gate_up.dtype == down.dtype == torch.float32 and x.device.type == "cpu",
        "grouped_mlp",
        "float32 tensors on the CPU",
    )
    _check(
        offsets.dtype == torch.int64 and offsets.shape == (experts + 1,),
        "grouped_mlp",
        "int64 offsets, one more than experts",
    )
    _check(
        x.shape[1] == hidden and down.shape == (experts, hidden, inter),
        "grouped_mlp",
        "x [R, H], gate_up [E, 2I, H] and down [E, H, I]",
    )
    x = x.contiguous()
    rows = x.shape[0]
    h = torch.empty(rows, inter, dtype=torch.float32)
    out = torch.zeros_like(x)
    _moe_library().grouped_mlp(
        x.data_ptr(),
        offsets.contiguous().data_ptr(),
        gate_up.contiguous().data_ptr(),
        down.contiguous().data_ptr(),
        h.data_ptr(),
        out.data_ptr(),
        rows,
        experts,
        hidden,
        inter,
        torch.get_num_threads(),
    )
    return out


_LIBRARY = torch.library.Library("updraft", "DEF")
_LIBRARY.define("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor")
_LIBRARY.impl("int8_linear", int8_linear, "CPU")
_LIBRARY.impl(
    "int8_linear", lambda x, weight, scale, bias: x.new_empty(x.shape[0], weight.shape[0]), "Meta"
)
_LIBRARY.define("float_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor")
_LIBRARY.impl("float_linear", float_linear, "CPU")
_LIBRARY.impl(
    "float_linear",
    lambda x, panels, bias, out_features: x.new_empty(x.shape[0], out_features),
    "Meta",
)
_LIBRARY.define(
    "paged_decode_attention(Tensor query, Tensor kv_cache, Tensor block_table, "
    "Tensor seq_lens, int block_size, float scale, bool with_lse=False) -> (Tensor, Tensor)"
)
_LIBRARY.impl("paged_decode_attention", paged_decode_attention, "CPU")
_LIBRARY.define(
    "paged_latent_attention(Tensor query, Tensor latent_cache, Tensor block_table, "
    "Tensor seq_lens, int block_size, float scale, int value_dim, bool with_lse=False) "
    "-> (Tensor, Tensor)"
)
_LIBRARY.impl("paged_latent_attention", paged_latent_attention, "CPU")


def _attention_meta(
    query: torch.Tensor, value_dim: int, with_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shapes of a decode-attention op's results."""
    lse = query.new_empty((*query.shape[:2],) if with_lse else (0,))
    return query.new_empty(*query.shape[:2], value_dim), lse


def _gqa_meta(query, cache, table, lens, block_size, scale, with_lse=False):
    return _attention_meta(query, query.shape[-1], with_lse)


def _latent_meta(query, cache, table, lens, block_size, scale, value_dim, with_lse=False):
    return _attention_meta(query, value_dim, with_lse)


_LIBRARY.impl("paged_decode_attention", _gqa_meta, "Meta")
_LIBRARY.impl("paged_latent_attention", _latent_meta, "Meta")
_LIBRARY.define("grouped_mlp(Tensor x, Tensor offsets, Tensor gate_up, Tensor down) -> Tensor")
_LIBRARY.impl("grouped_mlp", grouped_mlp, "CPU")
_LIBRARY.impl("grouped_mlp", lambda x, *rest: torch.empty_like(x), "Meta")


def build_int8_linear() -> None:
    """Build the linear kernels now, so a compiler problem shows at load, not mid-step."""
    _linear_library()


_LIBRARIES = {
    "linear": _linear_library,
    "paged_attention": _attention_library,
    "moe": _moe_library,
}


@cache
def kernel_builds(name: str) -> bool:
    """Whether kernel ``name`` ("linear", "paged_attention", "moe") builds and loads here (a
    C compiler is on PATH). Answered once per process: a failed build would otherwise be
    tried again by every caller."""
    try:
        _LIBRARIES[name]()
    except RuntimeError:
        return False
    return True
