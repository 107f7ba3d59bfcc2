"""A GGUF file's float tensors made the model's parameters, and its float linears packed.

A whole float parameter is the file's tensor itself, over its map, with no copy; the
slices of a fused one (q/k/v, gate/up) are copied into one new parameter. Packing then
turns each float linear into another layout (``pack_model``), so the file pages it was
read from, or the joined copy, are dropped or freed as each one is done rather than
once the whole model is: a 500M F32 file's load peaked at 6970 MiB for 2.5 GB of
weights before, 4482 after.
"""

from __future__ import annotations

import torch
from torch import nn

from updraft.models.packing import pack_model
from updraft.models.read_pages import MappedSpans
from updraft.models.weight_targets import FUSED, MadeParameters, is_split, part_of
from updraft.weights import WeightFormat


def fill_floats(
    model: nn.Module,
    floats: dict[str, dict[int, torch.Tensor]],
    file_name: str,
    spans: MappedSpans,
) -> None:
    """Each float parameter made real in its tensors' dtype: a whole one is the file's
    tensor itself (over its map, no copy), a fused one's slices are copied in (and the
    file pages they were read from dropped); a fused parameter lacking a part is refused
    before anything is made."""
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
    made = MadeParameters(model, "cpu")
    for name, slices in floats.items():
        if name not in params:
            continue  # a tied LM head's own copy of the embedding
        whole = next(iter(slices.values()))  # the one slice, if it is the whole
        if len(slices) == 1 and params[name].is_meta and whole.shape == params[name].shape:
            made.adopt(params[name], whole)
            continue
        real, module = made(params[name], whole.dtype)
        for index, tensor in slices.items():
            target = real if index == FUSED else part_of(real, module, name, index)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"GGUF tensor of shape {tuple(tensor.shape)} for {name}")
            target.data.copy_(tensor)
        spans.drop_unheld(slices.values(), model)


def pack_floats(model: nn.Module, fmt: WeightFormat, spans: MappedSpans, file_name: str) -> None:
    """Every parameter made real, or refused by name; then the float linears packed into
    ``fmt``, each one's file pages dropped as it is packed, not once the whole model is."""
    left = [name for name, param in model.named_parameters() if param.is_meta]
    if left:
        raise ValueError(f"{file_name}: no GGUF tensor for {left[:8]}")
    pack_model(
        model,
        fmt,
        torch.float32,
        packed=lambda linear: spans.dropped_after_packing(linear.weight, model),
    )
