"""Every safetensors tensor's shape checked against the parameter slices it fills, from
the files' headers, before any parameter is made.

The loader makes a parameter as its first tensor arrives; a config that sizes one part of
a fused parameter wrongly (a key/value head count of 100,000 beside a right query) would
have the whole made before the wrong part's tensor is read. Checked here first, nothing
the config made up is allocated: the first tensor that does not fit is refused with its
file, its shape, the parameter and the shape it takes.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open
from torch import nn

from updraft.models.weight_targets import part_of


def check_shapes(
    targets: dict[str, tuple[Path, list]],
    params: dict[str, nn.Parameter],
    modules: dict[str, nn.Module],
) -> None:
    """``targets``: each checkpoint tensor's file and the (parameter, slice) parts it
    fills, each with the row its part starts at in a fused tensor (or None)."""
    by_file: dict[Path, list[tuple[str, list]]] = {}
    for name, (path, parts) in targets.items():
        by_file.setdefault(path, []).append((name, parts))
    for path, entries in by_file.items():
        try:
            with safe_open(str(path), framework="pt", device="cpu") as reader:
                for name, parts in entries:
                    shape = tuple(reader.get_slice(name).get_shape())
                    for target, offset in parts:
                        _check(path, name, shape, target, offset, params, modules)
        except (SafetensorError, OSError) as error:
            raise ValueError(f"cannot read weights file {path}: {error}") from error


def _check(path, name, shape, target, offset, params, modules) -> None:
    param_name, index = target
    if index == -1:  # a slice the model does not keep
        return
    module = modules[param_name.rpartition(".")[0]]
    if getattr(module, "from_checkpoint", None) is not None:
        return  # laid out anew from the tensor's values: checked as it is read
    want = tuple(part_of(params[param_name], module, param_name, index).shape)
    got = (want[0], *shape[1:]) if offset is not None else shape  # rows: _check_fused's
    if got != want:
        raise ValueError(
            f"{path.name}: tensor {name!r} of shape {shape} cannot fill {param_name}, which "
            f"takes {want}"
        )
