"""``updraft::gguf_grouped_mlp``: a mixture-of-experts layer's routed experts over
weights in GGUF blocks, as ``updraft::grouped_mlp`` is over panels. Rows come sorted by
expert; each chosen expert's MLP (SiLU- or GELU-tanh-gated, as ``grouped_mlp``'s
``EXPERT_ACTIVATIONS`` index them, or gpt-oss's clamped SwiGLU with biases)
runs over its rows through the block kernels (``kernels/gguf_ops.py``): experts with a
few rows all in one C call that passes ``gguf_linear`` over each 8 of them, the others
each a chunk of weight rows widened and multiplied, reading only that expert's blocks, in
the file's bytes: nothing is widened beyond a chunk, and an idle expert is not read.

One op for the whole layer, so a captured graph holds it as one node whose shapes are
fixed by the token count: the split of rows among experts is read inside it, at each
run, from the offsets the graph computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from updraft.kernels.gguf_ops import (
    BLOCK_PASSES_UP_TO,
    gguf_grouped_rows,
    gguf_widened_linear,
)
from updraft.kernels.launch import check, define_op
from updraft.kernels.ops import EXPERT_ACTIVATIONS


def _widened_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    block_type: int,
    k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, k] @ the weight in ``blocks`` [N, row_bytes] transposed (+ bias) -> [M, N],
    the weight widened a chunk of rows at a time."""
    out = gguf_widened_linear(x, blocks, block_type, k, blocks.shape[0])
    return out if bias is None else out + bias


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float
) -> torch.Tensor:
    """gpt-oss's activation, as transformers computes it: gate clamped above at
    ``limit``, up into [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _activation(
    gate: torch.Tensor, up: torch.Tensor, swiglu: list[float] | None, activation: int
) -> torch.Tensor:
    """act(gate) * up (SiLU or GELU-tanh, by ``EXPERT_ACTIVATIONS`` index), or with
    ``swiglu`` = [alpha, limit] the clamped SwiGLU."""
    if swiglu is None:
        if EXPERT_ACTIVATIONS[activation] == "gelu_pytorch_tanh":
            return F.gelu(gate, approximate="tanh") * up
        return F.silu(gate) * up
    alpha, limit = swiglu
    return clamped_swiglu(gate, up, alpha, limit)


def gguf_grouped_mlp(
    x: torch.Tensor,
    offsets: torch.Tensor,
    gate_up: list[torch.Tensor],
    gate_up_types: list[int],
    down: torch.Tensor,
    down_type: int,
    inter: int,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    swiglu: list[float] | None = None,
    activation: int = 0,
) -> torch.Tensor:
    """Rows of x [R, H] grouped by expert (rows [offsets[e], offsets[e+1]) to expert e)
    through each expert's MLP -> [R, H]. ``gate_up``: the stacked gate and up
    projections in blocks, either one tensor [E, 2I, row_bytes] (gate rows, then up
    rows) or two [E, I, row_bytes], each of its own type in ``gate_up_types``; ``down``
    [E, H, row_bytes] of ``down_type``. Optional float32 biases [E, 2I] (gate, then up)
    and [E, H]; the activation act(gate) * up, act ``EXPERT_ACTIVATIONS[activation]``,
    or with ``swiglu`` = [alpha, limit] gpt-oss's clamped SwiGLU."""
    _check(x, offsets, gate_up, gate_up_types, down, inter, gate_up_bias, down_bias)
    check(swiglu is None or len(swiglu) == 2, "gguf_grouped_mlp", "swiglu [alpha, limit]")
    check(0 <= activation < len(EXPERT_ACTIVATIONS), "gguf_grouped_mlp", "an activation index")
    experts, hidden = down.shape[0], x.shape[1]
    rows_per_part = 2 * inter // len(gate_up)
    x, offsets = x.contiguous(), offsets.contiguous()
    out = torch.zeros_like(x)
    # Experts with a few rows (every expert of a decode step) in one C call; the rest, a
    # prefill's, here, each a widened GEMM.
    index = EXPERT_ACTIVATIONS.index("clamped_swiglu") if swiglu is not None else activation
    alpha, limit = swiglu or (0.0, 0.0)
    biases = (gate_up_bias, down_bias)
    gguf_grouped_rows(
        x,
        offsets,
        gate_up,
        gate_up_types,
        down,
        down_type,
        inter,
        biases,
        (index, alpha, limit),
        out,
    )
    bounds = offsets.tolist()
    for expert in range(experts):
        start, end = bounds[expert], bounds[expert + 1]
        if end - start <= BLOCK_PASSES_UP_TO:
            continue
        rows = x[start:end]
        biases = [None] * len(gate_up)
        if gate_up_bias is not None:
            biases = list(gate_up_bias[expert].split(rows_per_part))
        parts = [
            _widened_linear(rows, part[expert], code, hidden, bias)
            for part, code, bias in zip(gate_up, gate_up_types, biases, strict=True)
        ]
        gate, up = torch.cat(parts, dim=1).split(inter, dim=1)
        out[start:end] = _widened_linear(
            _activation(gate, up, swiglu, activation),
            down[expert],
            down_type,
            inter,
            None if down_bias is None else down_bias[expert],
        )
    return out


def _check(
    x: torch.Tensor,
    offsets: torch.Tensor,
    gate_up: list[torch.Tensor],
    gate_up_types: list[int],
    down: torch.Tensor,
    inter: int,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
) -> None:
    """gguf_grouped_mlp's tensors, each checked against the shape it must have."""
    op = "gguf_grouped_mlp"
    check(x.dtype == torch.float32 and x.dim() == 2, op, "float32 x [rows, hidden]")
    experts, hidden = down.shape[0], x.shape[1]
    check(
        offsets.dtype == torch.int64 and offsets.shape == (experts + 1,),
        op,
        "int64 offsets, one more than experts",
    )
    check(len(gate_up) in (1, 2) and len(gate_up_types) == len(gate_up), op, "gate and up parts")
    rows_per_part = 2 * inter // len(gate_up)
    for part in gate_up:
        check(part.dim() == 3 and part.shape[:2] == (experts, rows_per_part), op, "gate/up rows")
    check(down.dim() == 3 and down.shape[1] == hidden, op, f"down [experts, {hidden}, bytes]")
    for bias, rows in ((gate_up_bias, 2 * inter), (down_bias, hidden)):
        check(
            bias is None or (bias.dtype == torch.float32 and bias.shape == (experts, rows)),
            op,
            f"float32 biases [{experts}, {rows}]",
        )


define_op(
    "gguf_grouped_mlp(Tensor x, Tensor offsets, Tensor[] gate_up, int[] gate_up_types, "
    "Tensor down, int down_type, int inter, Tensor? gate_up_bias=None, "
    "Tensor? down_bias=None, float[]? swiglu=None, int activation=0) -> Tensor",
    gguf_grouped_mlp,
    lambda x, *rest: torch.empty_like(x),
)
