"""The C kernels as torch ops (``torch.ops.updraft.*``), with shape-only Meta versions.

A torch op, unlike a plain Python call, is seen by the dispatcher: graph capture
records it with its tensors and replays it like any aten op.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import torch

from updraft.kernels.build import load

PANEL = 16  # output rows per panel (``PANEL`` in linear.c)
INT4 = 4
QUANTIZED_FORMATS = (3, INT4)
# The element type of each format's codes (``enum format`` in linear.c).
CODE_DTYPES = {
    0: torch.float32,
    1: torch.bfloat16,
    2: torch.float16,
    3: torch.int8,
    INT4: torch.uint8,
}

_POINTER = ctypes.c_void_p
_INT = ctypes.c_int64


# Cached: ops call these on every step, and the argument types need setting only once.
@cache
def _linear_library(march: str = "native") -> ctypes.CDLL:
    lib = load("linear", march)
    lib.panel_linear.restype = lib.grouped_mlp.restype = None
    lib.panel_linear.argtypes = (
        [_POINTER, _POINTER, ctypes.c_int, _POINTER, _POINTER, _INT, _POINTER, _POINTER]
        + [_INT] * 4
        + [ctypes.c_int]
    )
    lib.grouped_mlp.argtypes = (
        [_POINTER, _POINTER, ctypes.c_int]
        + [_POINTER, _POINTER, _POINTER, _INT] * 2
        + [_POINTER] * 3
        + [_INT] * 4
        + [ctypes.c_int]
    )
    return lib


@cache
def _attention_library() -> ctypes.CDLL:
    lib = load("paged_attention")
    lib.paged_decode_attention.restype = None
    lib.paged_decode_attention.argtypes = (
        [_POINTER] * 8 + [_INT] * 9 + [ctypes.c_float, ctypes.c_int]
    )
    lib.write_kv.restype = None
    lib.write_kv.argtypes = [_POINTER, _INT, _INT, _POINTER, _INT, _POINTER, _INT, _POINTER, _INT]
    return lib


@cache
def _mask_library() -> ctypes.CDLL:
    lib = load("token_mask")
    lib.mask_logits.restype = None
    lib.mask_logits.argtypes = [_POINTER, _INT, _INT, _POINTER, _INT, _POINTER, _INT, ctypes.c_int]
    return lib


def mask_logits_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: in row ``rows[i]`` of ``logits`` [R, vocab] float32, every token whose
    bit in ``bitmask[i]`` (int32 words, one bit per token) is clear, or that lies past
    the bitmask, becomes -inf."""
    op = "mask_logits"
    _check(
        logits.dtype == torch.float32 and logits.is_contiguous() and logits.dim() == 2,
        op,
        "contiguous float32 logits [rows, vocab]",
    )
    _check(rows.dtype == torch.long and rows.dim() == 1, op, "int64 row indices")
    _check(
        bitmask.dtype == torch.int32 and bitmask.is_contiguous() and len(bitmask) == len(rows),
        op,
        "a contiguous int32 bitmask row per row index",
    )
    rows = rows.contiguous()
    _mask_library().mask_logits(
        logits.data_ptr(),
        logits.shape[0],
        logits.shape[1],
        rows.data_ptr(),
        len(rows),
        bitmask.data_ptr(),
        bitmask.shape[1],
        torch.get_num_threads(),
    )


def _check(condition: bool, op: str, what: str) -> None:
    if not condition:
        raise TypeError(f"updraft::{op} takes {what}")


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def writable_output(out: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether a kernel can write its float32 result of ``shape`` into ``out``."""
    return out.shape == shape and out.dtype == torch.float32 and out.is_contiguous()


def reads_copies(
    given: tuple[torch.Tensor | None, ...], used: tuple[torch.Tensor | None, ...]
) -> bool:
    """Whether any tensor the call reads is a copy of the one it was given."""
    return any(a is not b for a, b in zip(given, used, strict=True))


@dataclass(frozen=True)
class Launch:
    """One kernel call, checked, with every argument fixed: the addresses of the tensors
    it reads and writes, and its sizes. An op runs its launch once; a replayed graph
    re-runs it on the very tensors it was captured with (``kernels/bound_calls.py``),
    without the dispatcher or the checks. ``reads`` holds every tensor whose address is
    among the arguments (a contiguous copy made here would otherwise be freed before the
    call). ``copied_inputs``: the call reads such a copy (an input was not contiguous),
    so re-running it would read that copy, not the refreshed original."""

    function: Callable[..., None]
    arguments: tuple[Any, ...]
    outputs: tuple[torch.Tensor, ...]
    reads: tuple[torch.Tensor | None, ...]
    copied_inputs: bool
    # Where the arguments hold the row count of a call whose rows are independent of
    # each other (row r of the output reads row r of the input alone), so that the call
    # may run over leading rows only (``leading_rows``).
    rows_argument: int | None = None

    def __post_init__(self) -> None:
        # Each argument made its C type once: ctypes would otherwise convert every Python
        # int again at each call, about half of a small launch's cost.
        types = getattr(self.function, "argtypes", None)
        arguments = (
            self.arguments
            if not types
            else tuple(kind(value) for kind, value in zip(types, self.arguments, strict=True))
        )
        object.__setattr__(self, "_converted", arguments)
        object.__setattr__(self, "_call", partial(self.function, *arguments))

    def __call__(self) -> Any:
        self._call()
        return self.outputs

    @property
    def rows(self) -> int | None:
        """The rows the launch runs over, where they are independent, else None."""
        return None if self.rows_argument is None else self.arguments[self.rows_argument]

    def leading_rows(self, rows: int) -> None:
        """The call over its first ``rows`` rows only (at most ``self.rows``): the other
        rows of its outputs keep what they held."""
        index = self.rows_argument
        if index is None or not 0 <= rows <= self.arguments[index]:
            raise ValueError(f"a launch over {self.rows} rows cannot run over {rows}")
        arguments = self._converted
        self.function(*arguments[:index], rows, *arguments[index + 1 :])


def _check_codes(op: str, codes: torch.Tensor, scales, zeros, fmt: int, group: int) -> None:
    _check(fmt in CODE_DTYPES, op, f"a format among {sorted(CODE_DTYPES)}")
    _check(
        codes.dtype == CODE_DTYPES[fmt] and codes.is_contiguous(),
        op,
        f"contiguous {CODE_DTYPES[fmt]} codes for format {fmt}",
    )
    quantized = fmt in QUANTIZED_FORMATS
    _check((scales is not None) == quantized and group >= 0, op, "scales exactly when quantized")
    if quantized:
        _check(zeros is None or zeros.shape == scales.shape, op, "zeros shaped as the scales")
        for extra in (scales, zeros):
            _check(
                extra is None or (extra.dtype == torch.float32 and extra.is_contiguous()),
                op,
                "contiguous float32 scales and zeros",
            )


def panel_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor | None,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    fmt: int,
    group: int,
    out_features: int,
    march: str = "native",
) -> torch.Tensor:
    """x [M, K] float32 @ W [N, K]^T + bias -> [M, N] float32, W in the panels of
    ``kernels/panels.py`` in format ``fmt`` (N = ``out_features``; ``group`` K steps per
    scale when quantized). ``march``: the kernel built for other instructions than the
    machine's (tests of its narrower paths)."""
    return panel_linear_launch(x, codes, scales, zeros, bias, fmt, group, out_features, march)()[0]


def panel_linear_launch(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor | None,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    fmt: int,
    group: int,
    out_features: int,
    march: str = "native",
    out: tuple[torch.Tensor, ...] | None = None,
) -> Launch:
    """``panel_linear``'s checked call, into ``out`` (else a new tensor)."""
    op = "panel_linear"
    _check(x.dtype == torch.float32 and x.device.type == "cpu", op, "float32 x on the CPU")
    _check_codes(op, codes, scales, zeros, fmt, group)
    given = (x, bias)
    x = x.contiguous()
    rows, k = x.shape
    panels = -(-out_features // PANEL)
    width = PANEL // 2 if fmt == INT4 else PANEL
    _check(
        codes.shape == (panels, k, width),
        op,
        f"the panels of a [{out_features}, {k}] weight for x [{rows}, {k}]",
    )
    if scales is not None:
        _check(
            group > 0 and scales.shape == (panels, -(-k // group), PANEL),
            op,
            f"one scale per output row and group of {group} columns",
        )
    _check(bias is None or bias.shape == (out_features,), op, "one bias per output row")
    bias = None if bias is None else bias.float().contiguous()
    (result,) = out or (torch.empty(rows, out_features, dtype=torch.float32),)
    _check(writable_output(result, (rows, out_features)), op, "a contiguous float32 output")
    return Launch(
        _linear_library(march).panel_linear,
        (
            x.data_ptr(),
            codes.data_ptr(),
            fmt,
            _pointer(scales),
            _pointer(zeros),
            group,
            _pointer(bias),
            result.data_ptr(),
            out_features,
            rows,
            out_features,
            k,
            torch.get_num_threads(),
        ),
        (result,),
        (x, codes, scales, zeros, bias),
        reads_copies(given, (x, bias)),
        rows_argument=9,
    )


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
    """query [B, H, D] (one token per request), kv_cache [2, slots, Hkv, D], block_table
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
) -> Launch:
    """``paged_decode_attention``'s checked call, into ``out`` (else new tensors)."""
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
        starts,
        out,
    )


def writes_kv_in_one_call(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``write_kv`` takes these: a contiguous CPU cache [2, slots, heads, dim],
    and keys and values of its dtype whose rows are [heads, dim] laid out as the cache's
    (rows may be strided: views of a fused projection's output)."""
    row = kv_cache.shape[2:]
    return (
        kv_cache.device.type == "cpu"
        and kv_cache.dim() == 4
        and kv_cache.shape[1] > 0  # the kernel takes slots modulo their number
        and kv_cache.is_contiguous()
        and kernel_builds("paged_attention")
        and all(
            t.dtype == kv_cache.dtype
            and t.device == kv_cache.device
            and t.dim() == 3
            and t.shape[1:] == row
            and t.stride()[1:] == kv_cache.stride()[2:]
            for t in (key, value)
        )
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
) -> Launch:
    """``write_kv``'s checked call (``out``, for the bound-call registry, is unused: the
    op writes the cache it is given)."""
    op = "write_kv"
    _check(writes_kv_in_one_call(kv_cache, key, value), op, "keys and values shaped as the cache")
    _check(
        slot_mapping.dtype == torch.int64
        and slot_mapping.device.type == "cpu"
        and slot_mapping.dim() == 1
        and slot_mapping.shape[0] == key.shape[0] == value.shape[0],
        op,
        "an int64 slot per key and value row",
    )
    given = slot_mapping
    slot_mapping = slot_mapping.contiguous()
    size = kv_cache.element_size()
    return Launch(
        _attention_library().write_kv,
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
    )()


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
    starts: torch.Tensor | None = None,
    out: tuple[torch.Tensor, ...] | None = None,
) -> Launch:
    num_slots, kv_heads, head_dim, value_dim, slot_stride = geometry
    _check(
        query.dtype == caches[0].dtype == torch.float32 and query.device.type == "cpu",
        op,
        "float32 tensors on the CPU",
    )
    _check(
        block_table.dtype == seq_lens.dtype == torch.int64
        and (starts is None or (starts.dtype == torch.int64 and starts.shape == seq_lens.shape)),
        op,
        "int64 block tables and seq_lens (and starts, one per request)",
    )
    requests, heads, query_dim = query.shape
    _check(
        query_dim == head_dim
        and heads % kv_heads == 0
        and block_table.shape[0] == seq_lens.shape[0] == requests,
        op,
        "whole query-head groups and one block-table row and seq_len per request",
    )
    given = (query, block_table, seq_lens, starts)
    query = query.contiguous()
    block_table = block_table.contiguous()
    seq_lens = seq_lens.contiguous()
    starts = None if starts is None else starts.contiguous()
    result, lse = out or (
        query.new_empty(requests, heads, value_dim),
        query.new_empty((requests, heads) if with_lse else (0,)),
    )
    _check(
        writable_output(result, (requests, heads, value_dim))
        and writable_output(lse, (requests, heads) if with_lse else (0,)),
        op,
        "contiguous float32 outputs",
    )
    return Launch(
        _attention_library().paged_decode_attention,
        (
            query.data_ptr(),
            caches[0].data_ptr(),
            caches[1].data_ptr(),
            block_table.data_ptr(),
            seq_lens.data_ptr(),
            _pointer(starts),
            result.data_ptr(),
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
        ),
        (result, lse),
        (query, *caches, block_table, seq_lens, starts),
        reads_copies(given, (query, block_table, seq_lens, starts)),
    )


def grouped_mlp(
    x: torch.Tensor,
    offsets: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scales: torch.Tensor | None,
    gate_up_zeros: torch.Tensor | None,
    down: torch.Tensor,
    down_scales: torch.Tensor | None,
    down_zeros: torch.Tensor | None,
    fmt: int,
    gate_up_group: int,
    down_group: int,
    inter: int,
) -> torch.Tensor:
    """Rows of x [R, H] grouped by expert (rows [offsets[e], offsets[e+1]) to expert e)
    through each expert's SiLU MLP, whose gate_up [2I, H] and down [H, I] weights are in
    panels of format ``fmt``, stacked over experts -> [R, H]."""
    op = "grouped_mlp"
    _check(x.dtype == torch.float32 and x.device.type == "cpu", op, "float32 x on the CPU")
    experts, hidden = gate_up.shape[0], x.shape[1]
    _check(
        offsets.dtype == torch.int64 and offsets.shape == (experts + 1,),
        op,
        "int64 offsets, one more than experts",
    )
    width = PANEL // 2 if fmt == INT4 else PANEL
    for codes, scales, zeros, group, n, k in (
        (gate_up, gate_up_scales, gate_up_zeros, gate_up_group, 2 * inter, hidden),
        (down, down_scales, down_zeros, down_group, hidden, inter),
    ):
        _check_codes(op, codes, scales, zeros, fmt, group)
        _check(
            codes.shape == (experts, -(-n // PANEL), k, width),
            op,
            f"every expert's panels: gate_up [2I, H] and down [H, I], H={hidden}, I={inter}",
        )
        _check(
            scales is None
            or (group > 0 and scales.shape == (experts, codes.shape[1], -(-k // group), PANEL)),
            op,
            "one scale per expert, output row and group",
        )
    x = x.contiguous()
    rows = x.shape[0]
    gate_up_out = torch.empty(rows, 2 * inter, dtype=torch.float32)
    h = torch.empty(rows, inter, dtype=torch.float32)
    out = torch.zeros_like(x)
    _linear_library().grouped_mlp(
        x.data_ptr(),
        offsets.contiguous().data_ptr(),
        fmt,
        gate_up.data_ptr(),
        _pointer(gate_up_scales),
        _pointer(gate_up_zeros),
        gate_up_group,
        down.data_ptr(),
        _pointer(down_scales),
        _pointer(down_zeros),
        down_group,
        gate_up_out.data_ptr(),
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
_LIBRARY.define(
    "panel_linear(Tensor x, Tensor codes, Tensor? scales, Tensor? zeros, Tensor? bias, "
    "int fmt, int group, int out_features) -> Tensor"
)
_LIBRARY.impl("panel_linear", panel_linear, "CPU")
_LIBRARY.impl(
    "panel_linear",
    lambda x, codes, scales, zeros, bias, fmt, group, out_features: x.new_empty(
        x.shape[0], out_features
    ),
    "Meta",
)
_LIBRARY.define(
    "paged_decode_attention(Tensor query, Tensor kv_cache, Tensor block_table, "
    "Tensor seq_lens, int block_size, float scale, bool with_lse=False, Tensor? starts=None) "
    "-> (Tensor, Tensor)"
)
_LIBRARY.impl("paged_decode_attention", paged_decode_attention, "CPU")
_LIBRARY.define(
    "paged_latent_attention(Tensor query, Tensor latent_cache, Tensor block_table, "
    "Tensor seq_lens, int block_size, float scale, int value_dim, bool with_lse=False) "
    "-> (Tensor, Tensor)"
)
_LIBRARY.impl("paged_latent_attention", paged_latent_attention, "CPU")
_LIBRARY.define(
    "write_kv(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()"
)
_LIBRARY.impl("write_kv", write_kv, "CPU")
_LIBRARY.impl("write_kv", lambda kv_cache, key, value, slot_mapping: None, "Meta")


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


_LIBRARY.impl("paged_decode_attention", _gqa_meta, "Meta")
_LIBRARY.impl("paged_latent_attention", _latent_meta, "Meta")
_LIBRARY.define(
    "grouped_mlp(Tensor x, Tensor offsets, Tensor gate_up, Tensor? gate_up_scales, "
    "Tensor? gate_up_zeros, Tensor down, Tensor? down_scales, Tensor? down_zeros, int fmt, "
    "int gate_up_group, int down_group, int inter) -> Tensor"
)
_LIBRARY.impl("grouped_mlp", grouped_mlp, "CPU")
_LIBRARY.impl("grouped_mlp", lambda x, *rest: torch.empty_like(x), "Meta")


_LIBRARIES = {
    "linear": _linear_library,
    "paged_attention": _attention_library,
    "token_mask": _mask_library,
}


@cache
def kernel_builds(name: str) -> bool:
    """Whether kernel ``name`` ("linear", "paged_attention", "token_mask") builds and loads here (a
    C compiler is on PATH). Answered once per process: a failed build would otherwise be
    tried again by every caller."""
    try:
        _LIBRARIES[name]()
    except RuntimeError:
        return False
    return True
