"""A GGUF file's float tensors made the model's parameters, and its float linears packed.

A whole float parameter is the file's tensor itself, over its map, with no copy; the
slices of a fused one (q/k/v, gate/up) are copied into one new parameter. Packing then
turns each float linear into another layout (``pack_model``). Both go one decoder layer
at a time, the parts outside the layers first: a layer's joined copies are packed and
freed, and the file pages it was read from dropped, before the next layer is read. A
500M F32 file's load peaked at 6970 MiB for 2.5 GB of weights when the whole model was
read before it was packed; 4482 when only the pages went as each linear was packed, the
joined copies of every layer being made first.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from updraft.models.packed_linear import few_rows_for
from updraft.models.packing import EMBEDDINGS, pack_model
from updraft.models.read_pages import MappedSpans
from updraft.models.weight_targets import FUSED, MadeParameters, is_split, part_of
from updraft.weights import WeightFormat

# The decoder layer a parameter belongs to: "model.layers.3" of "model.layers.3.mlp...".
LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def fill_and_pack_floats(
    model: nn.Module,
    floats: dict[str, dict[int, torch.Tensor]],
    fmt: WeightFormat,
    spans: MappedSpans,
    file_name: str,
    place_experts: Callable[[str], object] = lambda under: None,
) -> None:
    """Each float parameter made real in its tensors' dtype and the float linears and
    experts packed into ``fmt``, one layer at a time (the parts outside the layers
    first, so a tied LM head is packed from the embedding while nothing else is): a
    whole parameter is the file's tensor itself (over its map, no copy), a fused one's
    slices are copied in; each one's file pages are dropped as it is packed.
    ``place_experts(layer)`` puts a layer's routed experts in before it is packed
    (``place_experts("")``: all that are left). A fused parameter lacking a part, or a
    parameter no tensor filled, is refused before anything is made."""
    _check_parts(model, floats, file_name)
    params = dict(model.named_parameters())  # the meta ones: no memory held
    few_rows = few_rows_for(model)  # decided from the whole model, before any is packed
    unheld = nn.Module()

    def packed(replaced: nn.Module) -> None:
        # An embedding's table is read by row: the rows a step looks up come back from
        # the page cache, so its pages go once the tied head that read them all is packed.
        tables = [m.weight for m in model.modules() if isinstance(m, EMBEDDINGS)]
        table = any(getattr(replaced, "weight", None) is weight for weight in tables)
        spans.dropped_after_packing(replaced, unheld if table else model)

    for layer, names in _by_layer(floats, params):
        _fill(model, {name: (params[name], floats[name]) for name in names}, spans)
        if layer:
            place_experts(layer)
        # Looked up now: a module held past its packing would hold its joined copy.
        pack_model(model.get_submodule(layer), fmt, torch.float32, few_rows, packed=packed)
    place_experts("")
    left = [name for name, param in model.named_parameters() if param.is_meta]
    if left:
        raise ValueError(f"{file_name}: no GGUF tensor for {left[:8]}")
    pack_model(model, fmt, torch.float32, few_rows, packed=packed)


def _check_parts(
    model: nn.Module, floats: dict[str, dict[int, torch.Tensor]], file_name: str
) -> None:
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    for name, slices in floats.items():
        module = modules.get(name.rpartition(".")[0])
        if name in params and FUSED not in slices and is_split(module):
            missing = [i for i in range(len(module.split_sizes)) if i not in slices]
            if missing:
                raise ValueError(
                    f"{file_name}: no tensor for part {missing[0]} (of "
                    f"{len(module.split_sizes)}) of {name}"
                )


def _by_layer(
    floats: dict[str, dict[int, torch.Tensor]], params: dict[str, nn.Parameter]
) -> list[tuple[str, list[str]]]:
    """The parameters to fill, by the module to pack once they are in: the whole model's
    ("") first, then each decoder layer's. A tied LM head's own copy of the embedding
    has no parameter of its own and is skipped."""
    layers: dict[str, list[str]] = {"": []}
    for name in floats:
        if name in params:
            match = LAYER.match(name)
            layers.setdefault(match[1] if match else "", []).append(name)
    return list(layers.items())


def _fill(
    model: nn.Module,
    filling: dict[str, tuple[nn.Parameter, dict[int, torch.Tensor]]],
    spans: MappedSpans,
) -> None:
    """Each parameter of ``filling`` (name: the meta parameter, its tensors by slice)
    made real. Nothing made is held past the call: a joined copy lives only in its module
    until that is packed."""
    made = MadeParameters(model, "cpu")
    for name, (param, slices) in filling.items():
        whole = next(iter(slices.values()))  # the one slice, if it is the whole
        if len(slices) == 1 and param.is_meta and whole.shape == param.shape:
            made.adopt(param, whole)
            continue
        real, module = made(param, whole.dtype)
        for index, tensor in slices.items():
            target = real if index == FUSED else part_of(real, module, name, index)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"GGUF tensor of shape {tuple(tensor.shape)} for {name}")
            target.data.copy_(tensor)
        spans.drop_unheld(slices.values(), model)
