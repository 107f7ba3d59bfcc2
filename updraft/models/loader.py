"""Load a Hugging Face checkpoint directory (safetensors, single or sharded) into a model.

Checkpoint names map onto the model's own parameters; q/k/v and gate/up tensors land in
slices of the fused projections. Every parameter slice must be filled exactly once: a
missing or unknown tensor is an error that names it and the files read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from updraft.config import ModelConfig, WeightFormat
from updraft.models.layers import FusedLinear
from updraft.models.moe import Experts
from updraft.models.packing import finish_loading, storage_dtype
from updraft.models.registry import model_class
from updraft.models.tensor_parallel import shard_model, splits_tensors
from updraft.parallel.topology import RankPlace

# checkpoint projection -> (fused parameter in the model, index of its slice), the first
# of these the model has
FUSED_SLICES = {
    "q_proj": (("qkv_proj", 0), ("qkv_a_proj", 0)),
    "k_proj": (("qkv_proj", 1),),
    "v_proj": (("qkv_proj", 2),),
    "gate_proj": (("gate_up_proj", 0),),
    "up_proj": (("gate_up_proj", 1),),
    "q_a_proj": (("qkv_a_proj", 0),),
    "kv_a_proj_with_mqa": (("qkv_a_proj", 1),),
}
# One expert's projection in a checkpoint -> its slice of the stacked expert weights:
# (parameter, part); gate and up are the two halves of gate_up_proj's rows.
EXPERT_TENSOR = re.compile(
    r"(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight"
)
EXPERT_PARTS = {"gate": ("gate_up_proj", 0), "up": ("gate_up_proj", 1), "down": ("down_proj", 0)}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
LAYER = re.compile(r"model\.layers\.(\d+)\.")


def layer_of(checkpoint_name: str) -> int | None:
    """The decoder layer a checkpoint tensor belongs to, if any."""
    match = LAYER.match(checkpoint_name)
    return None if match is None else int(match[1])


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as error:
            raise ValueError(f"corrupt weight index {index}: {error}") from error
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"no weights in {model_dir}: expected model.safetensors or "
                "model.safetensors.index.json with its shards"
            )
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"missing weights file {path}")
    return files


@contextmanager
def building(dtype: torch.dtype, device: torch.device | str) -> Iterator[None]:
    """Modules made inside get their parameters in ``dtype`` on ``device``."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(default_dtype)


def load_model(
    config: ModelConfig,
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    weights: WeightFormat | None = None,
    place: RankPlace | None = None,
) -> nn.Module:
    """The model computing in ``dtype``, its weights kept in ``weights`` (default: the
    compute dtype); with ``place``, only the shard that rank holds
    (models/tensor_parallel.py)."""
    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    fmt = weights or WeightFormat.of(dtype)
    with building(storage_dtype(fmt, dtype, config), device):
        model = model_class(config)(config, max_positions=max_positions)
    # A checkpoint's multi-token prediction layers follow its decoder layers; the model
    # does not run them (models/mtp.py loads them on their own).
    mtp = range(config.num_layers, config.num_layers + config.mtp_layers)
    load_weights(model, files, select=lambda name: layer_of(name) not in mtp)
    if splits_tensors(place):
        shard_model(model, place)
    return finish_loading(model, fmt, device, dtype)


@torch.no_grad()
def load_weights(
    model: nn.Module, files: list[Path], select: Callable[[str], bool] = lambda name: True
) -> None:
    """Fill every parameter slice of ``model`` from the tensors of ``files`` whose names
    ``select`` accepts: each exactly once, and every one of them somewhere."""
    params = dict(model.named_parameters())  # tied weights appear once
    modules = dict(model.named_modules())
    unfilled = {(name, index) for name, index in _slices(params, modules)}
    unknown = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as reader:
                for checkpoint_name in reader.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if checkpoint_name.endswith(IGNORED_SUFFIXES) or not select(checkpoint_name):
                        continue
                    target = _target(checkpoint_name, params)
                    if target is None:
                        unknown.append(checkpoint_name)
                        continue
                    _copy_into(params, modules, target, reader.get_tensor(checkpoint_name))
                    unfilled.discard(target)
        except (SafetensorError, OSError, RuntimeError) as error:
            raise ValueError(f"cannot read weights file {path}: {error}") from error
    names = ", ".join(str(f.name) for f in files)
    if unknown:
        raise ValueError(f"unexpected tensors {sorted(unknown)[:8]} in {names}")
    if unfilled:
        missing = sorted(_describe(name, index) for name, index in unfilled)
        raise ValueError(f"weights missing from {names}: {missing[:8]}")


def _slices(params: dict[str, nn.Parameter], modules: dict[str, nn.Module]):
    for name in params:
        module = modules[name.rpartition(".")[0]]
        if isinstance(module, FusedLinear):
            yield from ((name, index) for index in range(len(module.split_sizes)))
        elif isinstance(module, Experts):
            parts = (0, 1) if name.endswith("gate_up_proj") else (0,)
            for expert in range(module.num_experts):
                yield from ((name, (expert, part)) for part in parts)
        else:
            yield name, 0


Slice = int | tuple[int, int]  # a fused slice; or (expert, part) of stacked experts


def _describe(name: str, index: Slice) -> str:
    if isinstance(index, tuple):
        expert, part = index
        projection = ("up" if part else "gate") if name.endswith("gate_up_proj") else "down"
        return f"{name} (expert {expert}'s {projection}_proj)"
    return f"{name}[{index}]" if index else name


def _target(checkpoint_name: str, params: dict[str, nn.Parameter]) -> tuple[str, Slice] | None:
    expert = EXPERT_TENSOR.fullmatch(checkpoint_name)
    if expert is not None:
        param, part = EXPERT_PARTS[expert["proj"]]
        name = f"{expert['experts']}.{param}"
        return (name, (int(expert["expert"]), part)) if name in params else None
    module_path, _, kind = checkpoint_name.rpartition(".")
    parent, _, projection = module_path.rpartition(".")
    for fused, index in FUSED_SLICES.get(projection, ()):
        name = f"{parent}.{fused}.{kind}"
        if name in params:
            return name, index
    if checkpoint_name in params:
        return checkpoint_name, 0
    if checkpoint_name == "lm_head.weight" and "lm_head.weight" not in params:
        return "model.embed_tokens.weight", -1  # tied: the checkpoint repeats the embedding
    return None


def _copy_into(
    params: dict[str, nn.Parameter],
    modules: dict[str, nn.Module],
    target: tuple[str, Slice],
    tensor: torch.Tensor,
) -> None:
    name, index = target
    if index == -1:
        return
    param = params[name]
    module = modules[name.rpartition(".")[0]]
    if isinstance(index, tuple):  # one expert's gate, up or down rows
        expert, part = index
        param = param[expert]
        if name.endswith("gate_up_proj"):
            half = param.shape[0] // 2
            param = param.narrow(0, part * half, half)
    elif isinstance(module, FusedLinear):
        start = sum(module.split_sizes[:index])
        param = param.narrow(0, start, module.split_sizes[index])
    if param.shape != tensor.shape:
        raise ValueError(
            f"tensor shape {tuple(tensor.shape)} does not fit {name} {tuple(param.shape)}"
        )
    param.copy_(tensor)
