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

from updraft.config import ModelConfig, QuantizedCheckpoint, WeightFormat
from updraft.gguf_checkpoint import linked_files
from updraft.kernels.panels import pack_codes
from updraft.models.layers import FusedLinear
from updraft.models.moe import Experts
from updraft.models.packed_linear import PackedLinear
from updraft.models.packing import packer, storage_dtype
from updraft.models.prequantized import QuantizedCodes, unpack
from updraft.models.registry import model_class
from updraft.models.tensor_parallel import Shards, shard_model, splits_tensors
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
# (parameter, part); gate and up are the two halves of gate_up_proj's rows. Mixtral's
# checkpoints call them w1 (gate), w3 (up) and w2 (down).
EXPERT_TENSOR = re.compile(
    r"(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)"
    r"\.weight"
)
EXPERT_PARTS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
    "w1": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", 0),
}
# Mixtral's checkpoints hold a layer's experts and router in block_sparse_moe; the model
# names its mixture mlp, as Qwen3-MoE's checkpoints do.
RENAMED_MODULES = ((".block_sparse_moe.", ".mlp."),)
# A multimodal checkpoint's text tower (Gemma 3: transformers 5's names, then the older
# ones) is served as the text model; its vision tower and projector are not read.
TEXT_TOWER_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
VISION_PREFIXES = (
    "model.vision_tower.",
    "vision_tower.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
LAYER = re.compile(r"model\.layers\.(\d+)\.")


def text_name(checkpoint_name: str) -> str:
    """A checkpoint tensor's name as the text model calls it."""
    for prefix, renamed in TEXT_TOWER_PREFIXES:
        if checkpoint_name.startswith(prefix):
            return renamed + checkpoint_name[len(prefix) :]
    return checkpoint_name


def layer_of(checkpoint_name: str) -> int | None:
    """The decoder layer a checkpoint tensor belongs to, if any."""
    match = LAYER.match(text_name(checkpoint_name))
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
    int8_activations: bool = False,
) -> nn.Module:
    """The model computing in ``dtype``, its weights kept in ``weights`` (default: the
    compute dtype); with ``place``, only the shard that rank holds
    (models/tensor_parallel.py); with ``int8_activations``, a GGUF file's quantized
    linears round a decode step's x to int8 (``kernels/gguf_int8.c``). It is built on
    the meta device and filled tensor by tensor, each rank reading only what it keeps,
    each layer packed once its weights are in: at no point does the process hold the
    whole model in the checkpoint's dtype."""
    gguf = linked_files(Path(model_dir))
    if gguf is not None:
        from updraft.models.gguf_loader import load_gguf_model

        if splits_tensors(place):
            raise ValueError("a GGUF file is not split over tensor-parallel ranks yet")
        if weights is not None and weights != WeightFormat.of(dtype):
            raise ValueError(f"a GGUF file keeps its own weight types; {weights} was asked")
        return load_gguf_model(config, gguf, dtype, device, max_positions, int8_activations)
    if int8_activations:
        raise ValueError(
            f"{model_dir}: --activations int8 is for a GGUF file's quantized blocks, and "
            "this is not a GGUF file"
        )
    fmt = weights or WeightFormat.of(dtype)
    with building(storage_dtype(fmt, dtype, config), "meta"):
        model = model_class(config)(config, max_positions=max_positions)
    files = weight_files(Path(model_dir))
    # Pre-quantized linears are found by their tensors' names, read once for both steps.
    names = {} if config.quantized is None else checkpoint_names(files)
    quantized = {} if config.quantized is None else make_slots(model, names, config.quantized)
    owned = {
        f"{prefix}.{suffix}"
        for parts in quantized.values()
        for prefix in parts.values()
        for suffix in config.quantized.suffixes
    }
    # A checkpoint's multi-token prediction layers follow its decoder layers; the model
    # does not run them (models/mtp.py loads them on their own).
    mtp = range(config.num_layers, config.num_layers + config.mtp_layers)
    model = fill(
        model,
        files,
        fmt,
        dtype,
        device,
        select=lambda name: layer_of(name) not in mtp and name not in owned,
        place=place,
    )
    if quantized:
        fill_slots(model, names, config.quantized, quantized)
    return model


# -- linears quantized before they reach here (models/prequantized.py) ------------------


class QuantizedSlot(nn.Module):
    """Where a pre-quantized linear waits while the rest of the model loads: its shape
    and split, and its bias, which fills like any tensor."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.split_sizes = getattr(linear, "split_sizes", None)
        self.bias = linear.bias


def make_slots(
    model: nn.Module, names: dict[Path, list[str]], scheme: QuantizedCheckpoint
) -> dict[str, dict[Slice, str]]:
    """Put a ``QuantizedSlot`` in place of each linear the checkpoint (its tensor
    ``names``, by file) holds quantized; returns, per linear (module name), the
    checkpoint prefix of each of its slices."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    found: dict[str, dict[Slice, str]] = {}
    for held in names.values():
        for name in held:
            prefix, _, suffix = name.rpartition(".")
            if suffix != scheme.marker or name.startswith(VISION_PREFIXES):
                continue
            target = _target(f"{prefix}.weight", params, modules)
            if target is None or isinstance(target[1], tuple):
                raise ValueError(
                    f"{name}: a {scheme.method} tensor of no linear layer here (quantized "
                    "experts are not read)"
                )
            param, index = target
            found.setdefault(param.removesuffix(".weight"), {})[index] = prefix
    for module_name in found:
        parent, _, child = module_name.rpartition(".")
        setattr(modules[parent], child, QuantizedSlot(modules[module_name]))
    return found


def fill_slots(
    model: nn.Module,
    names: dict[Path, list[str]],
    scheme: QuantizedCheckpoint,
    slots: dict[str, dict[Slice, str]],
) -> None:
    """Read each slot's quantized tensors into int4 panels (codes as they are) and put a
    ``PackedLinear`` over them in its place."""
    where = {name: path for path, held in names.items() for name in held}
    modules = dict(model.named_modules())
    for module_name, parts in slots.items():
        slot = modules[module_name]
        sizes = slot.split_sizes or [slot.out_features]
        order = [FUSED] if FUSED in parts else list(range(len(sizes)))
        missing = [i for i in order if i not in parts]
        if missing:
            raise ValueError(f"{module_name}: no {scheme.marker} for its part(s) {missing}")
        unpacked = [
            unpack(scheme, _read(where, parts[i], scheme.suffixes), slot.in_features) for i in order
        ]
        codes = QuantizedCodes(
            torch.cat([part.codes for part in unpacked]),
            torch.cat([part.scales for part in unpacked]),
            torch.cat([part.zeros for part in unpacked]),
            unpacked[0].group,
        )
        if codes.codes.shape[0] != slot.out_features:
            raise ValueError(
                f"{module_name}: {scheme.method} tensors hold {codes.codes.shape[0]} rows, "
                f"the layer {slot.out_features}"
            )
        panels = pack_codes(codes.codes, codes.scales, codes.zeros, "int4", codes.group)
        fmt = WeightFormat("int4", codes.group, zero_point=True)
        parent, _, child = module_name.rpartition(".")
        setattr(modules[parent], child, PackedLinear.over(panels, slot.bias, fmt))


def _read(where: dict[str, Path], prefix: str, suffixes: tuple[str, ...]) -> dict:
    """One linear's tensors that the checkpoint holds, by suffix, each file opened once."""
    wanted = {suffix: f"{prefix}.{suffix}" for suffix in suffixes if f"{prefix}.{suffix}" in where}
    tensors = {}
    for path in {where[name] for name in wanted.values()}:
        with safe_open(str(path), framework="pt", device="cpu") as reader:
            for suffix, name in wanted.items():
                if where[name] == path:
                    tensors[suffix] = reader.get_tensor(name)
    return tensors


def fill(
    model: nn.Module,
    files: list[Path],
    fmt: WeightFormat,
    dtype: torch.dtype,
    device: torch.device | str,
    select: Callable[[str], bool] = lambda name: True,
    place: RankPlace | None = None,
    split: Callable[[nn.Module, RankPlace], Shards] = shard_model,
) -> nn.Module:
    """``model``, built on the meta device, filled from ``files`` (``load_weights``),
    packed into ``fmt`` as it fills where it computes in ``dtype`` on the CPU, and ready
    to run on ``device``; with ``place``, ``split`` keeps the rank's shard of it."""
    pack = packer(fmt, device, dtype)  # refuses a format that cannot run here, first
    shard = (lambda model: split(model, place)) if splits_tensors(place) else None
    load_weights(model, files, select, device, shard, loaded=pack)
    return model.to(device).eval().requires_grad_(False)  # .to: the rotary tables


@torch.no_grad()
def load_weights(
    model: nn.Module,
    files: list[Path],
    select: Callable[[str], bool] = lambda name: True,
    device: torch.device | str = "cpu",
    shard: Callable[[nn.Module], Shards] | None = None,
    loaded: Callable[[nn.Module], None] | None = None,
) -> None:
    """Fill every parameter slice of ``model`` from the tensors of ``files`` whose names
    ``select`` accepts: each exactly once, and every one of them somewhere. A parameter
    on the meta device is made on ``device`` as it fills. ``shard`` splits the model
    (on the meta device) and says what the rank keeps of each parameter: each tensor is
    read from its memory-mapped file only as far as it is kept. The tensors go one
    decoder layer at a time, each file open only while its layer reads from it;
    ``loaded(model)`` follows each layer and the rest."""
    params = dict(model.named_parameters())  # tied weights appear once
    modules = dict(model.named_modules())
    unfilled = set(_slices(params, modules))
    targets, unknown = {}, []
    for path, names in checkpoint_names(files).items():
        for checkpoint_name in names:
            if (
                checkpoint_name.endswith(IGNORED_SUFFIXES)
                or checkpoint_name.startswith(VISION_PREFIXES)
                or not select(checkpoint_name)
            ):
                continue
            target = _target(checkpoint_name, params, modules)
            if target is None:
                unknown.append(checkpoint_name)
            else:
                targets[checkpoint_name] = (path, _parts(target, modules))
    listed = ", ".join(str(f.name) for f in files)
    if unknown:
        raise ValueError(f"unexpected tensors {sorted(unknown)[:8]} in {listed}")
    kept = shard(model) if shard is not None else {}
    made = _Made(model, device)
    by_layer: dict[int | None, list[str]] = {}
    for checkpoint_name in targets:
        by_layer.setdefault(layer_of(checkpoint_name), []).append(checkpoint_name)
    order = [*sorted(key for key in by_layer if key is not None), None]
    for layer in order:
        for path in files:
            names = [n for n in by_layer.get(layer, ()) if targets[n][0] == path]
            if not names:
                continue
            try:
                with safe_open(str(path), framework="pt", device="cpu") as reader:
                    for checkpoint_name in names:
                        source = reader.get_slice(checkpoint_name)
                        parts = targets[checkpoint_name][1]
                        _check_fused(checkpoint_name, source, parts, modules)
                        for target, offset in parts:
                            _fill(params, modules, target, source, kept, made, offset)
                            unfilled.discard(target)
            except (SafetensorError, OSError, RuntimeError) as error:
                raise ValueError(f"cannot read weights file {path}: {error}") from error
        if loaded is not None:
            loaded(model)
    if unfilled:
        missing = sorted(_describe(name, index) for name, index in unfilled)
        raise ValueError(f"weights missing from {listed}: {missing[:8]}")
    made.check()


def checkpoint_names(files: list[Path]) -> dict[Path, list[str]]:
    """The names of the tensors each of ``files`` holds (read from its header only)."""
    names = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as reader:
                names[path] = list(reader.keys())
        except (SafetensorError, OSError, RuntimeError) as error:
            raise ValueError(f"cannot read weights file {path}: {error}") from error
    return names


class _Made:
    """The real parameters that replace a model's meta ones as they fill: each made
    once (zeros, so that rows no tensor fills, a padded vocabulary's, are zero) and put
    in every module that holds it (a tied weight is one parameter)."""

    def __init__(self, model: nn.Module, device: torch.device | str) -> None:
        self.model = model
        self.device = device
        self.holders: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                self.holders.setdefault(id(param), []).append((module, name))
        self.real: dict[int, nn.Parameter] = {}

    def __call__(
        self, param: nn.Parameter, dtype: torch.dtype | None = None
    ) -> tuple[nn.Parameter, nn.Module]:
        """``param`` made real (in ``dtype``, default its own), and the module that
        holds it."""
        holders = self.holders[id(param)]
        if param.is_meta:
            if id(param) not in self.real:
                data = torch.zeros(param.shape, dtype=dtype or param.dtype, device=self.device)
                real = nn.Parameter(data, requires_grad=False)
                for module, name in holders:
                    setattr(module, name, real)
                self.real[id(param)] = real
            param = self.real[id(param)]
        return param, holders[0][0]

    def check(self) -> None:
        left = [name for name, param in self.model.named_parameters() if param.is_meta]
        if left:
            raise ValueError(f"parameters no checkpoint tensor filled: {left[:8]}")


def _slices(params: dict[str, nn.Parameter], modules: dict[str, nn.Module]):
    for name in params:
        module = modules[name.rpartition(".")[0]]
        if _split(module):
            yield from ((name, index) for index in range(len(module.split_sizes)))
        elif isinstance(module, Experts):
            parts = (0, 1) if name.endswith("gate_up_proj") else (0,)
            for expert in range(module.num_experts):
                yield from ((name, (expert, part)) for part in parts)
        else:
            yield name, 0


Slice = int | tuple[int, int]  # a fused slice; or (expert, part) of stacked experts


def _split(module: nn.Module | None) -> bool:
    """Whether ``module``'s parameters stack several checkpoint projections."""
    return isinstance(module, FusedLinear) or getattr(module, "split_sizes", None) is not None


def _describe(name: str, index: Slice) -> str:
    if isinstance(index, tuple):
        expert, part = index
        projection = ("up" if part else "gate") if name.endswith("gate_up_proj") else "down"
        return f"{name} (expert {expert}'s {projection}_proj)"
    return f"{name}[{index}]" if index else name


def _target(
    checkpoint_name: str, params: dict[str, nn.Parameter], modules: dict[str, nn.Module]
) -> tuple[str, Slice] | None:
    checkpoint_name = text_name(checkpoint_name)
    for old, new in RENAMED_MODULES:
        checkpoint_name = checkpoint_name.replace(old, new)
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
        module = modules.get(checkpoint_name.rpartition(".")[0])
        return checkpoint_name, FUSED if _split(module) else 0
    if checkpoint_name == "lm_head.weight" and "lm_head.weight" not in params:
        return "model.embed_tokens.weight", -1  # tied: the checkpoint repeats the embedding
    return None


# A checkpoint tensor's place in the model: one slice, or for a checkpoint that fuses
# the projections itself (Phi-3's qkv_proj, gate_up_proj) every slice of the fused
# parameter, each at its row offset in the tensor.
FUSED = -2


def _parts(target: tuple[str, Slice], modules: dict[str, nn.Module]):
    name, index = target
    if index != FUSED:
        return [(target, None)]
    sizes = modules[name.rpartition(".")[0]].split_sizes
    return [((name, i), sum(sizes[:i])) for i in range(len(sizes))]


def _check_fused(checkpoint_name: str, source, parts, modules) -> None:
    if parts[0][1] is None:
        return
    name = parts[0][0][0]
    sizes = modules[name.rpartition(".")[0]].split_sizes
    rows = source.get_shape()[0]
    if rows != sum(sizes):
        raise ValueError(
            f"tensor {checkpoint_name} has {rows} rows; the fused {name} has {sum(sizes)} "
            f"({' + '.join(map(str, sizes))})"
        )


def _part(param: torch.Tensor, module: nn.Module, name: str, index: Slice) -> torch.Tensor:
    """The slice ``index`` of ``param`` (held by ``module`` as ``name``)."""
    if isinstance(index, tuple):  # one expert's gate, up or down rows
        expert, part = index
        param = param[expert]
        if name.endswith("gate_up_proj"):
            half = param.shape[0] // 2
            param = param.narrow(0, part * half, half)
    elif _split(module):
        start = sum(module.split_sizes[:index])
        param = param.narrow(0, start, module.split_sizes[index])
    return param


def _fill(
    params: dict[str, nn.Parameter],
    modules: dict[str, nn.Module],
    target: tuple[str, Slice],
    source,  # a safetensors slice: a tensor not yet read
    kept: Shards,
    made: _Made,
    offset: int | None = None,  # where this slice's rows start in a fused tensor
) -> None:
    name, index = target
    if index == -1:
        return
    param = params[name]
    whole = _part(param, modules[name.rpartition(".")[0]], name, index)
    shape = tuple(source.get_shape())
    first = offset or 0
    if offset is not None:
        shape = (whole.shape[0], *shape[1:])
    if tuple(whole.shape) != shape:
        raise ValueError(f"tensor shape {shape} does not fit {name} {tuple(whole.shape)}")
    keep = kept.get(param)
    own, module = made(keep.param if keep is not None else param)
    if keep is not None and keep.zeros:
        return
    part = _part(own, module, name, index)
    if keep is None or keep.dim is None:
        part.copy_(source[:] if offset is None else source[first : first + shape[0]])
        return
    rows = keep.parts[index[1] if isinstance(index, tuple) else index]
    stop = min(rows.stop, shape[keep.dim])  # the last vocabulary shard's padding
    if keep.dim == 0:
        read = source[first + rows.start : first + stop]
    else:
        read = source[first : first + shape[0], rows.start : stop]
    part.narrow(keep.dim, 0, stop - rows.start).copy_(read)
