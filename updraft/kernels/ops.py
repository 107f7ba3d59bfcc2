"""The linear and expert kernels, and the token mask, as torch ops
(``torch.ops.updraft.*``) with shape-only Meta versions. Attention's kernels are
``attention_ops.py``; what every op shares is ``launch.py``.

A torch op, unlike a plain Python call, is seen by the dispatcher: graph capture
records it with its tensors and replays it like any aten op.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from updraft.kernels.build import load
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

PANEL = 16  # output rows per panel (``PANEL`` in linear.c)
BF16, INT4 = 1, 4
# bfloat16 panels whose batches multiply x rounded to bfloat16 where the CPU has
# AVX512-BF16 (``BF16_PRODUCTS`` in linear.c; ``bf16_product_rows``)
BF16_PRODUCTS = 5
QUANTIZED_FORMATS = (3, INT4)
# The gate activations ``grouped_mlp`` applies, by index.
EXPERT_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "clamped_swiglu")
# The element type of each format's codes (``enum format`` in linear.c).
CODE_DTYPES = {
    0: torch.float32,
    1: torch.bfloat16,
    2: torch.float16,
    3: torch.int8,
    INT4: torch.uint8,
    BF16_PRODUCTS: torch.bfloat16,
}


def panel_shape(fmt: int, panels: int, k: int) -> tuple[int, ...]:
    """The codes of ``panels`` panels of K = ``k`` in format ``fmt``: [P, K, 16]; int4's
    [P, K, 8] bytes; bfloat16's in pairs of steps, [P, ceil(K / 2), 16, 2]."""
    if fmt in (BF16, BF16_PRODUCTS):
        return (panels, -(-k // 2), PANEL, 2)
    return (panels, k, PANEL // 2 if fmt == INT4 else PANEL)


# Cached: ops call these on every step, and the argument types need setting only once.
@cache
def _linear_library(march: str = "native") -> ctypes.CDLL:
    lib = load("linear", march)
    lib.panel_linear.restype = lib.grouped_mlp.restype = None
    lib.bf16_product_rows.restype, lib.bf16_product_rows.argtypes = ctypes.c_int, []
    lib.panel_linear.argtypes = (
        [POINTER, POINTER, ctypes.c_int, POINTER, POINTER, INT, POINTER, POINTER]
        + [INT] * 4
        + [ctypes.c_int]
    )
    lib.grouped_mlp.argtypes = (
        [POINTER, POINTER, ctypes.c_int]
        + [POINTER, POINTER, POINTER, INT] * 2
        + [POINTER] * 3
        + [INT] * 4
        + [ctypes.c_int] * 2
        + [POINTER, POINTER, ctypes.c_float, ctypes.c_float]
    )
    return lib


@cache
def _mask_library() -> ctypes.CDLL:
    lib = load("token_mask")
    lib.mask_logits.restype = None
    lib.mask_logits.argtypes = [POINTER, INT, INT, POINTER, INT, POINTER, INT, ctypes.c_int]
    return lib


def mask_logits_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: in row ``rows[i]`` of ``logits`` [R, vocab] float32, every token whose
    bit in ``bitmask[i]`` (int32 words, one bit per token) is clear, or that lies past
    the bitmask, becomes -inf."""
    op = "mask_logits"
    check(
        logits.dtype == torch.float32 and logits.is_contiguous() and logits.dim() == 2,
        op,
        "contiguous float32 logits [rows, vocab]",
    )
    check(rows.dtype == torch.long and rows.dim() == 1, op, "int64 row indices")
    check(
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


def _check_codes(op: str, codes: torch.Tensor, scales, zeros, fmt: int, group: int) -> None:
    check(fmt in CODE_DTYPES, op, f"a format among {sorted(CODE_DTYPES)}")
    check(
        codes.dtype == CODE_DTYPES[fmt] and codes.is_contiguous(),
        op,
        f"contiguous {CODE_DTYPES[fmt]} codes for format {fmt}",
    )
    quantized = fmt in QUANTIZED_FORMATS
    check((scales is not None) == quantized and group >= 0, op, "scales exactly when quantized")
    if quantized:
        check(zeros is None or zeros.shape == scales.shape, op, "zeros shaped as the scales")
        for extra in (scales, zeros):
            check(
                extra is None or (extra.dtype == torch.float32 and extra.is_contiguous()),
                op,
                "contiguous float32 scales and zeros",
            )


def bf16_product_rows(march: str = "native") -> int:
    """From how many rows of x the ``BF16_PRODUCTS`` format multiplies x rounded to
    bfloat16, in the kernel built for ``march``; 0 where that build has no AVX512-BF16
    (there it is the exact bfloat16 format)."""
    return _linear_library(march).bf16_product_rows()


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
    check(x.dtype == torch.float32 and x.device.type == "cpu", op, "float32 x on the CPU")
    _check_codes(op, codes, scales, zeros, fmt, group)
    given = (x, bias)
    x = x.contiguous()
    rows, k = x.shape
    panels = -(-out_features // PANEL)
    check(
        codes.shape == panel_shape(fmt, panels, k),
        op,
        f"the panels of a [{out_features}, {k}] weight for x [{rows}, {k}]",
    )
    if scales is not None:
        check(
            group > 0 and scales.shape == (panels, -(-k // group), PANEL),
            op,
            f"one scale per output row and group of {group} columns",
        )
    check(bias is None or bias.shape == (out_features,), op, "one bias per output row")
    bias = None if bias is None else bias.float().contiguous()
    (result,) = out or (torch.empty(rows, out_features, dtype=torch.float32),)
    check(writable_output(result, (rows, out_features)), op, "a contiguous float32 output")
    return Launch(
        _linear_library(march).panel_linear,
        (
            x.data_ptr(),
            codes.data_ptr(),
            fmt,
            pointer(scales),
            pointer(zeros),
            group,
            pointer(bias),
            result.data_ptr(),
            out_features,
            rows,
            out_features,
            k,
            0,  # threads: torch's count when it runs, not when a graph bound it
        ),
        (result,),
        (x, codes, scales, zeros, bias),
        reads_copies(given, (x, bias)),
        rows_argument=9,
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
    activation: int = 0,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    swiglu_alpha: float = 0.0,
    swiglu_limit: float = 0.0,
    march: str = "native",
) -> torch.Tensor:
    """Rows of x [R, H] grouped by expert (rows [offsets[e], offsets[e+1]) to expert e)
    through each expert's gated MLP, whose gate_up [2I, H] and down [H, I] weights are in
    panels of format ``fmt``, stacked over experts -> [R, H]. ``activation``: the gate's,
    an index of ``EXPERT_ACTIVATIONS`` (gpt-oss's clamped SwiGLU with ``swiglu_alpha``
    and ``swiglu_limit``); gpt-oss's experts' biases gate_up_bias [E, 2I] and down_bias
    [E, H]. ``march``: the build to run (tests of the narrower ones)."""
    op = "grouped_mlp"
    check(x.dtype == torch.float32 and x.device.type == "cpu", op, "float32 x on the CPU")
    experts, hidden = gate_up.shape[0], x.shape[1]
    check(
        offsets.dtype == torch.int64 and offsets.shape == (experts + 1,),
        op,
        "int64 offsets, one more than experts",
    )
    for codes, scales, zeros, group, n, k in (
        (gate_up, gate_up_scales, gate_up_zeros, gate_up_group, 2 * inter, hidden),
        (down, down_scales, down_zeros, down_group, hidden, inter),
    ):
        _check_expert_panels(op, codes, scales, zeros, fmt, group, n, k, (experts, hidden, inter))
    for bias, shape in ((gate_up_bias, (experts, 2 * inter)), (down_bias, (experts, hidden))):
        check(
            bias is None or (bias.dtype == torch.float32 and bias.shape == shape),
            op,
            f"float32 biases gate_up [E, 2I] and down [E, H], E={experts}, H={hidden}, I={inter}",
        )
    gate_up_bias, down_bias = (
        b if b is None else b.contiguous() for b in (gate_up_bias, down_bias)
    )
    x = x.contiguous()
    rows = x.shape[0]
    gate_up_out = torch.empty(rows, 2 * inter, dtype=torch.float32)
    h = torch.empty(rows, inter, dtype=torch.float32)
    out = torch.zeros_like(x)
    _linear_library(march).grouped_mlp(
        x.data_ptr(),
        offsets.contiguous().data_ptr(),
        fmt,
        gate_up.data_ptr(),
        pointer(gate_up_scales),
        pointer(gate_up_zeros),
        gate_up_group,
        down.data_ptr(),
        pointer(down_scales),
        pointer(down_zeros),
        down_group,
        gate_up_out.data_ptr(),
        h.data_ptr(),
        out.data_ptr(),
        rows,
        experts,
        hidden,
        inter,
        torch.get_num_threads(),
        activation,
        pointer(gate_up_bias),
        pointer(down_bias),
        swiglu_alpha,
        swiglu_limit,
    )
    return out


def _check_expert_panels(
    op: str,
    codes: torch.Tensor,
    scales: torch.Tensor | None,
    zeros: torch.Tensor | None,
    fmt: int,
    group: int,
    n: int,
    k: int,
    sizes: tuple[int, int, int],  # experts, hidden, inter
) -> None:
    experts, hidden, inter = sizes
    _check_codes(op, codes, scales, zeros, fmt, group)
    check(
        codes.shape == (experts, *panel_shape(fmt, -(-n // PANEL), k)),
        op,
        f"every expert's panels: gate_up [2I, H] and down [H, I], H={hidden}, I={inter}",
    )
    check(
        scales is None
        or (group > 0 and scales.shape == (experts, codes.shape[1], -(-k // group), PANEL)),
        op,
        "one scale per expert, output row and group",
    )


define_op(
    "panel_linear(Tensor x, Tensor codes, Tensor? scales, Tensor? zeros, Tensor? bias, "
    "int fmt, int group, int out_features) -> Tensor",
    panel_linear,
    lambda x, codes, scales, zeros, bias, fmt, group, out_features: x.new_empty(
        x.shape[0], out_features
    ),
)
define_op(
    "grouped_mlp(Tensor x, Tensor offsets, Tensor gate_up, Tensor? gate_up_scales, "
    "Tensor? gate_up_zeros, Tensor down, Tensor? down_scales, Tensor? down_zeros, int fmt, "
    "int gate_up_group, int down_group, int inter, int activation=0, "
    "Tensor? gate_up_bias=None, Tensor? down_bias=None, float swiglu_alpha=0.0, "
    "float swiglu_limit=0.0) -> Tensor",
    grouped_mlp,
    lambda x, *rest: torch.empty_like(x),
)
