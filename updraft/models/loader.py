"""Load a Hugging Face checkpoint directory (safetensors, single or sharded) into a model.

Checkpoint names map onto the model's own parameters; q/k/v and gate/up tensors land in
slices of the fused projections. Every parameter slice must be filled exactly once: a
missing or unknown tensor is an error that names it and the files read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from updraft.checkpoints.gguf import linked_files
from updraft.kernels.panels import pack_codes
from updraft.model_config import ModelConfig
from updraft.models.checkpoint_shapes import check_shapes
from updraft.models.gguf_loader import load_gguf_model
from updraft.models.grouped_linear import grouped_or_none
from updraft.models.mapped_table import MappedEmbedding, mapped_tensor
from updraft.models.moe import Experts
from updraft.models.mxfp4_experts import fill_mxfp4, mxfp4_slots, slot_tensors
from updraft.models.packed_linear import PackedLinear
from updraft.models.packing import packer, storage_dtype
from updraft.models.prequantized import QuantizedCodes, unpack
from updraft.models.registry import model_class
from updraft.models.tensor_parallel import Shards, pieces, shard_model, splits_tensors
from updraft.models.weight_targets import (
    FUSED,
    LaidOut,
    MadeParameters,
    Slice,
    building,
    is_split,
    part_of,
    target_of,
    text_name,
)
from updraft.parallel.topology import RankPlace
from updraft.weights import QuantizedCheckpoint, WeightFormat

VISION_PREFIXES = (
    "model.vision_tower.",
    "vision_tower.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
    "model.visual.",  # Qwen3.5's
    "model.audio_tower.",  # Gemma 4's, and its towers' projections
    "model.embed_vision.",
    "model.embed_audio.",
)
# Qwen3.5's multi-token prediction layer, kept apart from the decoder's layers.
MTP_PREFIX = "mtp."
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
LAYER = re.compile(r"model\.layers\.(\d+)\.")


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
    (models/tensor_parallel.py); with ``int8_activations``, its quantized linears (a
    GGUF file's blocks, the int8 and int4 formats, AWQ/GPTQ codes) round x to int8
    (``kernels/gguf_int8.c``). It is built on
    the meta device and filled tensor by tensor, each rank reading only what it keeps,
    each layer packed once its weights are in: at no point does the process hold the
    whole model in the checkpoint's dtype."""
    fmt = weights or WeightFormat.of(dtype)
    gguf = linked_files(Path(model_dir))
    if gguf is not None:
        if fmt != WeightFormat.of(dtype):
            raise ValueError(f"a GGUF file keeps its own weight types; {weights} was asked")
        return load_gguf_model(
            config, gguf, dtype, device, max_positions, int8_activations, place, fmt.exact
        )
    _refuse_int8_on_floats(model_dir, fmt, config, int8_activations)
    with building(storage_dtype(fmt, dtype, config), "meta"):
        model = model_class(config)(config, max_positions=max_positions)
    files = weight_files(Path(model_dir))
    # Pre-quantized linears are found by their tensors' names, read once for both steps.
    names = {} if config.quantized is None else checkpoint_names(files)
    quantized, experts, owned = prequantized_slots(model, config, names)
    # A checkpoint's multi-token prediction layers follow its decoder layers; the model
    # does not run them (models/mtp.py loads them on their own).
    mtp = range(config.num_layers, config.num_layers + config.mtp_layers)
    tables = {m.name: m for m in model.modules() if isinstance(m, MappedEmbedding)}
    unused = getattr(model, "unused_tensor", lambda name: False)
    model = fill(
        model,
        files,
        fmt,
        dtype,
        device,
        select=lambda name: (
            layer_of(name) not in mtp
            and not name.startswith(MTP_PREFIX)
            and name not in owned
            and text_name(name) not in tables
            and not unused(text_name(name))
        ),
        place=place,
        int8=int8_activations,
    )
    if quantized:
        fill_slots(model, names, config.quantized, quantized, int8_activations)
    if experts:
        fill_mxfp4(model, names, experts)
    if tables:
        attach_tables(tables, files, device)
    return model


def _refuse_int8_on_floats(
    model_dir: str | Path, fmt: WeightFormat, config: ModelConfig, int8_activations: bool
) -> None:
    """``--activations int8`` is for quantized weights; refused, by name, on float ones."""
    if int8_activations and not fmt.quantized and config.quantized is None:
        raise ValueError(
            f"{model_dir}: --activations int8 is for quantized weights (a GGUF file's "
            f"blocks, --quantization int8 or int4, AWQ/GPTQ codes), and these are {fmt}"
        )


def prequantized_slots(
    model: nn.Module, config: ModelConfig, names: dict[Path, list[str]]
) -> tuple[dict, dict, set[str]]:
    """A pre-quantized checkpoint's slots: its quantized linears', or (gpt-oss's MXFP4
    checkpoints, which quantize experts) its experts', and the tensors they read, which
    the float fill leaves out."""
    mxfp4 = config.quantized is not None and config.quantized.method == "mxfp4"
    experts = mxfp4_slots(model, names) if mxfp4 else {}
    quantized = (
        {} if config.quantized is None or mxfp4 else make_slots(model, names, config.quantized)
    )
    owned = slot_tensors(experts) | {
        f"{prefix}.{suffix}"
        for parts in quantized.values()
        for prefix in parts.values()
        for suffix in config.quantized.suffixes
    }
    return quantized, experts, owned


def attach_tables(
    tables: dict[str, MappedEmbedding], files: list[Path], device: torch.device | str
) -> None:
    """Map each table from the file that holds it, as it is there (``mapped_table.py``);
    on a device other than the CPU it is copied there, in the file's dtype."""
    found = {
        text_name(name): (path, name)
        for path, held in checkpoint_names(files).items()
        for name in held
    }
    for name, table in tables.items():
        if name not in found:
            listed = ", ".join(str(f.name) for f in files)
            raise ValueError(f"weights missing from {listed}: {name}")
        mapped = mapped_tensor(*found[name])
        table.attach(mapped if torch.device(device).type == "cpu" else mapped.to(device))


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
            target = target_of(f"{prefix}.weight", params, modules)
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
    int8: bool = False,
) -> None:
    """Read each slot's quantized tensors into int4 panels (codes as they are) and put a
    ``PackedLinear`` over them in its place; with ``int8`` (activations), into the int8
    kernel's groups and a ``GroupedLinear``, where their shape fits one."""
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
        fmt = WeightFormat("int4", codes.group, zero_point=True)
        parent, _, child = module_name.rpartition(".")
        linear = None
        if int8:
            grouped = (codes.codes, codes.scales, codes.zeros, fmt, codes.group, slot.bias)
            linear = grouped_or_none(*grouped)
        if linear is None:
            panels = pack_codes(codes.codes, codes.scales, codes.zeros, "int4", codes.group)
            linear = PackedLinear.over(panels, slot.bias, fmt)
        setattr(modules[parent], child, linear)


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
    int8: bool = False,
) -> nn.Module:
    """``model``, built on the meta device, filled from ``files`` (``load_weights``),
    packed into ``fmt`` as it fills where it computes in ``dtype`` on the CPU (``int8``:
    for activations rounded to int8), and ready to run on ``device``; with ``place``,
    ``split`` keeps the rank's shard of it."""
    pack = packer(fmt, device, dtype, int8)  # refuses a format that cannot run here, first
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
    targets = _targets(files, select, params, modules)
    check_shapes(targets, params, modules)  # before anything is made
    listed = ", ".join(str(f.name) for f in files)
    kept = shard(model) if shard is not None else {}
    made = MadeParameters(model, device)
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
                            unfilled.difference_update(_covered(target, params, modules))
            except (SafetensorError, OSError, RuntimeError) as error:
                raise ValueError(f"cannot read weights file {path}: {error}") from error
        if loaded is not None:
            loaded(model)
    if unfilled:
        missing = sorted(_describe(name, index) for name, index in unfilled)
        raise ValueError(f"weights missing from {listed}: {missing[:8]}")
    made.check()


def _targets(
    files: list[Path],
    select: Callable[[str], bool],
    params: dict[str, nn.Parameter],
    modules: dict[str, nn.Module],
) -> dict[str, tuple[Path, list]]:
    """Each selected checkpoint tensor's file and the parameter slices it fills; a
    tensor that fits no parameter is an error that names it."""
    targets, unknown = {}, []
    for path, names in checkpoint_names(files).items():
        for checkpoint_name in names:
            if (
                checkpoint_name.endswith(IGNORED_SUFFIXES)
                or checkpoint_name.startswith(VISION_PREFIXES)
                or not select(checkpoint_name)
            ):
                continue
            target = target_of(checkpoint_name, params, modules)
            if target is None:
                unknown.append(checkpoint_name)
            else:
                targets[checkpoint_name] = (path, _parts(target, modules))
    if unknown:
        listed = ", ".join(str(f.name) for f in files)
        raise ValueError(f"unexpected tensors {sorted(unknown)[:8]} in {listed}")
    return targets


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


def _slices(params: dict[str, nn.Parameter], modules: dict[str, nn.Module]):
    for name in params:
        module = modules[name.rpartition(".")[0]]
        if is_split(module):
            yield from ((name, index) for index in range(len(module.split_sizes)))
        elif isinstance(module, Experts):
            parts = (0, 1) if name.endswith("gate_up_proj") else (0,)
            for expert in range(module.num_experts):
                yield from ((name, (expert, part)) for part in parts)
        else:
            yield name, 0


def _covered(target: tuple[str, Slice], params, modules) -> set[tuple[str, Slice]]:
    """The slices a tensor filling ``target`` fills: a stacked experts tensor as the
    checkpoint holds it ([E, ...], transformers 5's layout) fills every expert's."""
    name, index = target
    if index == 0 and isinstance(modules[name.rpartition(".")[0]], Experts):
        return set(_slices({name: params[name]}, modules))
    return {target}


def _describe(name: str, index: Slice) -> str:
    if isinstance(index, tuple):
        expert, part = index
        projection = ("up" if part else "gate") if name.endswith("gate_up_proj") else "down"
        return f"{name} (expert {expert}'s {projection}_proj)"
    return f"{name}[{index}]" if index else name


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


def _fill(
    params: dict[str, nn.Parameter],
    modules: dict[str, nn.Module],
    target: tuple[str, Slice],
    source,  # a safetensors slice: a tensor not yet read
    kept: Shards,
    made: MadeParameters,
    offset: int | None = None,  # where this slice's rows start in a fused tensor
) -> None:
    name, index = target
    if index == -1:
        return
    param = params[name]
    module_name, _, own_name = name.rpartition(".")
    laid_out = getattr(modules[module_name], "from_checkpoint", None)
    if laid_out is not None:  # a module that keeps its tensors unlike the checkpoint
        source = LaidOut(laid_out(own_name, source[:]))
    whole = part_of(param, modules[module_name], name, index)
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
    part = part_of(own, module, name, index)
    if keep is None or keep.dim is None:
        part.copy_(source[:] if offset is None else source[first : first + shape[0]])
        return
    rows = keep.parts[index[1] if isinstance(index, tuple) else index]
    at = 0  # where the next range lands in the rank's part
    for piece in pieces(rows):
        stop = min(piece.stop, shape[keep.dim])  # the last vocabulary shard's padding
        if keep.dim == 0:
            read = source[first + piece.start : first + stop]
        else:
            read = source[first : first + shape[0], piece.start : stop]
        part.narrow(keep.dim, at, stop - piece.start).copy_(read)
        at += piece.stop - piece.start
