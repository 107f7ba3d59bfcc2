"""Load a Hugging Face checkpoint directory (safetensors, single or sharded) into a model.

Checkpoint names map onto the model's own parameters; q/k/v and gate/up tensors land in
slices of the fused projections. Every parameter slice must be filled exactly once: a
missing or unknown tensor is an error that names it and the files read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from updraft.config import ModelConfig
from updraft.models.int8_linear import can_quantize_int8, quantize_linears
from updraft.models.llama import FusedLinear
from updraft.models.packed_linear import can_prepack, prepack_linears
from updraft.models.registry import model_class

# checkpoint projection -> (fused parameter in the model, index of its slice)
FUSED_SLICES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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


def load_model(
    config: ModelConfig,
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    quantization: str | None = None,
) -> nn.Module:
    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(config)(config, max_positions=max_positions)
    finally:
        torch.set_default_dtype(default_dtype)
    load_weights(model, files)
    if quantization == "int8":
        if not can_quantize_int8(torch.device(device), dtype):
            raise ValueError(
                f"quantization 'int8' runs on the CPU in float32, not on {device} in {dtype}"
            )
        quantize_linears(model)
    elif can_prepack(torch.device(device), dtype):
        prepack_linears(model)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def load_weights(model: nn.Module, files: list[Path]) -> None:
    params = dict(model.named_parameters())  # tied weights appear once
    modules = dict(model.named_modules())
    unfilled = {(name, index) for name, index in _slices(params, modules)}
    unknown = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as reader:
                for checkpoint_name in reader.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if checkpoint_name.endswith(IGNORED_SUFFIXES):
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
        missing = sorted(f"{name}[{index}]" if index else name for name, index in unfilled)
        raise ValueError(f"weights missing from {names}: {missing[:8]}")


def _slices(params: dict[str, nn.Parameter], modules: dict[str, nn.Module]):
    for name in params:
        module = modules[name.rpartition(".")[0]]
        if isinstance(module, FusedLinear):
            yield from ((name, index) for index in range(len(module.split_sizes)))
        else:
            yield name, 0


def _target(checkpoint_name: str, params: dict[str, nn.Parameter]) -> tuple[str, int] | None:
    module_path, _, kind = checkpoint_name.rpartition(".")
    parent, _, projection = module_path.rpartition(".")
    if projection in FUSED_SLICES:
        fused, index = FUSED_SLICES[projection]
        name = f"{parent}.{fused}.{kind}"
        return (name, index) if name in params else None
    if checkpoint_name in params:
        return checkpoint_name, 0
    if checkpoint_name == "lm_head.weight" and "lm_head.weight" not in params:
        return "model.embed_tokens.weight", -1  # tied: the checkpoint repeats the embedding
    return None


def _copy_into(
    params: dict[str, nn.Parameter],
    modules: dict[str, nn.Module],
    target: tuple[str, int],
    tensor: torch.Tensor,
) -> None:
    name, index = target
    if index == -1:
        return
    param = params[name]
    module = modules[name.rpartition(".")[0]]
    if isinstance(module, FusedLinear):
        start = sum(module.split_sizes[:index])
        param = param.narrow(0, start, module.split_sizes[index])
    if param.shape != tensor.shape:
        raise ValueError(
            f"tensor shape {tuple(tensor.shape)} does not fit {name} {tuple(param.shape)}"
        )
    param.copy_(tensor)
