"""A GGUF file's mixture of experts, as its metadata and tensors give it: llama.cpp
writes ``<arch>.expert_count`` and ``expert_used_count`` and stacks each layer's routed
experts in one tensor per projection (``blk.N.ffn_gate_exps``, ``ffn_up_exps``,
``ffn_down_exps`` [experts, rows, columns], or gate and up fused in
``ffn_gate_up_exps``) beside the router ``ffn_gate_inp`` and any shared experts
(``ffn_gate_shexp``, ``ffn_up_shexp``, ``ffn_down_shexp``). Widths are read from the
tensors themselves, and checked against the metadata where it states them, so a
family's parser only names them as its config.json does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Tensors = dict[str, tuple[str, tuple[int, ...]]]  # name -> (type, shape, rows first)


@dataclass(frozen=True)
class ExpertShape:
    num_experts: int
    experts_per_token: int
    width: int  # one routed expert's intermediate rows
    shared_width: int  # the shared experts' rows together (0: none)
    dense_layers: tuple[int, ...]  # layers with one MLP and no router


def read_experts(file_name: str, get: Any, tensors: Tensors, layers: int) -> ExpertShape | None:
    """The experts of a file whose ``get(key, default)`` reads its ``<arch>.`` metadata,
    or None where it has none."""
    count = int(get("expert_count", 0) or 0)
    if count == 0:
        return None
    used = int(get("expert_used_count", 0) or 0)
    if not 0 < used <= count:
        raise ValueError(
            f"{file_name}: expert_used_count {used} is not between 1 and the {count} experts"
        )
    routed = [layer for layer in range(layers) if f"blk.{layer}.ffn_gate_inp.weight" in tensors]
    if not routed:
        raise ValueError(f"{file_name}: expert_count is {count} but no layer has a router")
    first = routed[0]
    width = _routed_width(file_name, tensors, first, count)
    _check_stated(file_name, "expert_feed_forward_length", get, width)
    down = tensors.get(f"blk.{first}.ffn_down_shexp.weight")
    shared = down[1][-1] if down is not None else 0
    if shared:
        _check_stated(file_name, "expert_shared_feed_forward_length", get, shared)
    dense = tuple(layer for layer in range(layers) if layer not in routed)
    return ExpertShape(count, used, width, shared, dense)


def _routed_width(file_name: str, tensors: Tensors, layer: int, count: int) -> int:
    """An expert's rows, from layer ``layer``'s stacked down projection [E, H, I] (or
    fused gate and up [E, 2I, H])."""
    down = tensors.get(f"blk.{layer}.ffn_down_exps.weight")
    fused = tensors.get(f"blk.{layer}.ffn_gate_up_exps.weight")
    if down is None:
        raise ValueError(f"{file_name}: layer {layer} has a router but no ffn_down_exps")
    shape = down[1]
    if len(shape) != 3 or shape[0] != count:
        raise ValueError(
            f"{file_name}: blk.{layer}.ffn_down_exps has shape {shape}, not [{count}, rows, "
            "columns] for the file's expert_count"
        )
    if fused is not None and fused[1][1] != 2 * shape[2]:
        raise ValueError(
            f"{file_name}: blk.{layer}.ffn_gate_up_exps has {fused[1][1]} rows per expert, "
            f"not twice the down projection's {shape[2]} columns"
        )
    return shape[2]


def _check_stated(file_name: str, key: str, get: Any, width: int) -> None:
    stated = get(key)
    if stated is not None and int(stated) != width:
        raise ValueError(f"{file_name}: {key} is {stated} but the tensors are {width} wide")
