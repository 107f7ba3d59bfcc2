"""A gpt-oss GGUF file's experts put into the model's ``GptOssExperts``, or, where the
file keeps them in MXFP4 blocks, an ``Mxfp4Experts`` over those blocks.

llama.cpp's converter writes a layer's experts as ``ffn_gate_exps``, ``ffn_up_exps``
[E, I, H] and ``ffn_down_exps`` [E, H, I] (rows of their inputs: transformers' float
tensors transposed, its interleaved gate/up columns split), each with a float bias
[E, I] or [E, H]: the gate rows then the up rows are exactly the layout
``GptOssExperts`` keeps (``gate_up_proj`` [E, 2I, H]). An MXFP4 checkpoint's experts
reach the file as ggml's MXFP4 blocks (type 39) in that same row layout, which is
``Mxfp4Experts``' own: its gate and up blocks are joined, nothing is widened. Experts in
any other block type are refused: gpt-oss's clamped SwiGLU and biases run on float or
MXFP4 weights only.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from updraft.kernels.gguf_ops import BLOCKS
from updraft.models.gguf_tensors import FLOAT_DTYPES, block_rows, float_tensor
from updraft.models.gpt_oss import GptOssExperts
from updraft.models.mxfp4_experts import MXFP4, Mxfp4Experts

PROJECTIONS = ("gate", "up", "down")
# One stacked tensor as the file holds it: its type name and its data.
Held = tuple[str, np.ndarray]


def gpt_oss_experts(
    file_name: str, experts: GptOssExperts, parts: Mapping[str, Held], where: str
) -> nn.Module:
    """The experts at ``where`` from ``parts`` (``gate``, ``up``, ``down`` and each
    one's ``.bias``): float weights filled into ``experts``, MXFP4 blocks as
    ``Mxfp4Experts``."""
    names = [*PROJECTIONS, *(f"{proj}.bias" for proj in PROJECTIONS)]
    missing = [name for name in names if name not in parts]
    if missing:
        tensor, _, part = missing[0].partition(".")
        raise ValueError(f"{file_name}: {where} has no ffn_{tensor}_exps.{part or 'weight'} tensor")
    num_experts, rows, hidden = experts.gate_up_proj.shape
    inter = rows // 2
    biases = {}
    for proj, width in (("gate", inter), ("up", inter), ("down", hidden)):
        kind, data = parts[f"{proj}.bias"]
        if kind not in FLOAT_DTYPES:
            raise ValueError(f"{file_name}: {where}'s {proj} biases are {kind}, not floats")
        biases[proj] = _checked(
            file_name, where, f"{proj} biases", float_tensor(data, kind), (num_experts, width)
        )
    gate_up_bias = torch.cat([biases["gate"], biases["up"]], dim=1).float()
    down_bias = biases["down"].float()
    kinds = {parts[proj][0] for proj in PROJECTIONS}
    shapes = {"gate": (num_experts, inter, hidden), "up": (num_experts, inter, hidden)}
    shapes["down"] = (num_experts, hidden, inter)
    if kinds <= FLOAT_DTYPES.keys():
        weights = {
            proj: _checked(
                file_name, where, proj, float_tensor(parts[proj][1], parts[proj][0]), shape
            )
            for proj, shape in shapes.items()
        }
        experts.gate_up_proj = _param(torch.cat([weights["gate"], weights["up"]], dim=1))
        experts.down_proj = _param(weights["down"])
        experts.gate_up_bias = _param(gate_up_bias)
        experts.down_bias = _param(down_bias)
        return experts  # packed with the model's other float weights
    if kinds != {"MXFP4"}:
        raise ValueError(
            f"{file_name}: {where}'s experts are {sorted(kinds)}; gpt-oss's are read in "
            f"float ({', '.join(FLOAT_DTYPES)}) or MXFP4"
        )
    values, size = BLOCKS[MXFP4]
    blocks = {}
    for proj, (count, out_rows, inputs) in shapes.items():
        if inputs % values:
            raise ValueError(
                f"{file_name}: {where}'s {proj} has {inputs} inputs, not whole MXFP4 blocks"
            )
        shape = (count, out_rows, inputs // values * size)
        blocks[proj] = _checked(file_name, where, proj, block_rows(parts[proj][1]), shape)
    gate_up = torch.cat([blocks["gate"], blocks["up"]], dim=1)
    return Mxfp4Experts(
        gate_up, gate_up_bias, blocks["down"], down_bias, experts.alpha, experts.limit
    )


def _checked(
    file_name: str, where: str, what: str, tensor: torch.Tensor, shape: tuple
) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(
            f"{file_name}: {where}'s {what} have shape {list(tensor.shape)}, the model's "
            f"config wants {list(shape)}"
        )
    return tensor


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)
