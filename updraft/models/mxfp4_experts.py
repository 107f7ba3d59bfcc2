"""gpt-oss's routed experts as its checkpoints ship them, in MXFP4, kept so.

A Hugging Face gpt-oss checkpoint with ``quantization_config.quant_method`` "mxfp4"
holds each layer's experts as ``model.layers.N.mlp.experts.{gate_up,down}_proj_blocks``
[E, rows, K / 32, 16] (two FP4 codes a byte) and ``..._scales`` [E, rows, K / 32] (one
E8M0 byte per 32 codes), rows being output features: gate_up's 2I rows interleave gate
and up (gate even, up odd), down has H rows of I inputs. The biases stay floats.

They are read into ggml's MXFP4 blocks (``kernels/gguf_blocks.c``, type 39: the scale
byte, then 16 bytes whose low nibbles are codes 0..15 and high nibbles 16..31; the
checkpoint's bytes pair codes 2j and 2j + 1 instead), one expert at a time, nibbles
moved and nothing widened: 17 bytes per 32 weights. The codes' meaning is the same in
both (ggml doubles the FP4 values and halves the scale), so the scale byte is copied as
it is. gate_up's rows are de-interleaved as rows of blocks, gate rows then up rows, as
the float experts hold them. ``updraft::gguf_grouped_mlp`` runs a layer's experts in one
op, with the biases and the clamped SwiGLU.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

import updraft.kernels.gguf_grouped  # noqa: F401  (defines updraft::gguf_grouped_mlp)
from updraft.kernels.gguf_ops import BLOCK_TYPES, BLOCKS
from updraft.models.moe import RoutedExperts, expert_offsets
from updraft.models.weight_targets import text_name

MXFP4 = BLOCK_TYPES["MXFP4"]
VALUES, BLOCK_BYTES = BLOCKS[MXFP4]  # 32 codes in 17 bytes
CODE_BYTES = VALUES // 2
PROJECTIONS = ("gate_up_proj", "down_proj")
# What each layer's experts hold in an MXFP4 checkpoint, by suffix.
SUFFIXES = tuple(f"{proj}_{part}" for proj in PROJECTIONS for part in ("blocks", "scales", "bias"))


def ggml_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A checkpoint's MXFP4 codes [..., G, 16] (code 2j in byte j's low nibble, 2j + 1 in
    its high one) and scales [..., G] -> ggml's blocks [..., G * 17] of the same codes."""
    low, high = blocks & 0xF, blocks >> 4
    codes = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 32], in order
    packed = codes[..., :CODE_BYTES] | (codes[..., CODE_BYTES:] << 4)
    return torch.cat((scales.unsqueeze(-1), packed), dim=-1).flatten(-2)


class Mxfp4Experts(RoutedExperts):
    """gpt-oss's routed experts over MXFP4 blocks: gate_up [E, 2I, H / 32 * 17] (gate
    rows, then up rows) with gate_up_bias [E, 2I], down [E, H, I / 32 * 17] with
    down_bias [E, H]; the clamped SwiGLU between them."""

    def __init__(
        self,
        gate_up: torch.Tensor,
        gate_up_bias: torch.Tensor,
        down: torch.Tensor,
        down_bias: torch.Tensor,
        alpha: float,
        limit: float,
    ) -> None:
        super().__init__()
        self.num_experts = down.shape[0]
        self.inter = gate_up.shape[1] // 2
        self.alpha, self.limit = alpha, limit
        self.register_buffer("gate_up", gate_up, persistent=False)
        self.register_buffer("gate_up_bias", gate_up_bias, persistent=False)
        self.register_buffer("down", down, persistent=False)
        self.register_buffer("down_bias", down_bias, persistent=False)

    def _grouped(
        self, rows: torch.Tensor, chosen: torch.Tensor, order: torch.Tensor
    ) -> torch.Tensor:
        return torch.ops.updraft.gguf_grouped_mlp(
            rows,
            expert_offsets(chosen, self.num_experts),
            [self.gate_up],
            [MXFP4],
            self.down,
            MXFP4,
            self.inter,
            self.gate_up_bias,
            self.down_bias,
            [self.alpha, self.limit],
        )

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, in MXFP4 blocks"


def _expected(proj: str, experts: int, hidden: int, inter: int) -> dict[str, tuple]:
    """Each tensor of ``proj`` and the shape it must have, with the shape's words."""
    rows, inputs = (2 * inter, hidden) if proj == "gate_up_proj" else (hidden, inter)
    if inputs % VALUES:
        raise ValueError(f"MXFP4 experts' {proj} has {inputs} inputs, not whole blocks of 32")
    groups = inputs // VALUES
    return {
        f"{proj}_blocks": ((experts, rows, groups, CODE_BYTES), "experts, rows, blocks, 16"),
        f"{proj}_scales": ((experts, rows, groups), "experts, rows, blocks"),
        f"{proj}_bias": ((experts, rows), "experts, rows"),
    }


def _checked(name: str, path: Path, tensor, shape: tuple[int, ...], words: str):
    """``tensor`` (a safetensors slice) if it has ``shape`` (and codes are bytes)."""
    if tuple(tensor.get_shape()) != shape:
        raise ValueError(
            f"{path.name}: {name} has shape {list(tensor.get_shape())}, not {list(shape)} [{words}]"
        )
    if name.endswith(("_blocks", "_scales")) and tensor.get_dtype() != "U8":
        raise ValueError(f"{path.name}: {name} is {tensor.get_dtype()}, not uint8 (U8)")
    return tensor


def read_mxfp4_experts(
    where: dict[str, Path],
    prefix: str,
    shape: tuple[int, int, int],
    alpha: float,
    limit: float,
) -> Mxfp4Experts:
    """The experts at checkpoint ``prefix`` (``model.layers.N.mlp.experts``), their
    tensors found in ``where`` (name -> file), of ``shape`` (experts, hidden, inter):
    each tensor's shape checked by name, then its blocks read one expert at a time."""
    experts, hidden, inter = shape
    # gate_up's interleaved rows (gate even, up odd) -> gate rows, then up rows
    deinterleave = torch.cat((torch.arange(0, 2 * inter, 2), torch.arange(1, 2 * inter, 2)))
    out: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        readers: dict[Path, Any] = {}
        for proj in PROJECTIONS:
            expected = _expected(proj, experts, hidden, inter)
            tensors = []
            for suffix, (dims, words) in expected.items():
                name = f"{prefix}.{suffix}"
                if name not in where:
                    raise ValueError(f"an MXFP4 checkpoint has no {name}")
                path = where[name]
                if path not in readers:
                    readers[path] = stack.enter_context(safe_open(str(path), "pt", device="cpu"))
                tensors.append(_checked(name, path, readers[path].get_slice(name), dims, words))
            blocks, scales, bias = tensors
            rows, groups = expected[f"{proj}_scales"][0][1:]
            order = deinterleave if proj == "gate_up_proj" else torch.arange(rows)
            packed = torch.empty(experts, rows, groups * BLOCK_BYTES, dtype=torch.uint8)
            for expert in range(experts):
                packed[expert] = ggml_blocks(blocks[expert][order], scales[expert][order])
            out[proj] = packed
            out[f"{proj}_bias"] = bias[:].float()[:, order].contiguous()
    return Mxfp4Experts(
        out["gate_up_proj"],
        out["gate_up_proj_bias"],
        out["down_proj"],
        out["down_proj_bias"],
        alpha,
        limit,
    )


def mxfp4_bytes(module: nn.Module) -> int:
    """Bytes the MXFP4 experts' blocks take in ``module``."""
    return sum(
        part.gate_up.nbytes + part.down.nbytes
        for part in module.modules()
        if isinstance(part, Mxfp4Experts)
    )


# -- the loader's two steps: slots before the float weights fill, experts after -------


class Mxfp4Slot(nn.Module):
    """Where a layer's MXFP4 experts wait while the rest of the model loads: the float
    experts' shape and activation, and the checkpoint prefix of their tensors."""

    def __init__(self, experts: nn.Module, prefix: str) -> None:
        super().__init__()
        num_experts, rows, hidden = experts.gate_up_proj.shape  # [E, 2I, H]
        self.shape = (num_experts, hidden, rows // 2)
        self.alpha, self.limit = experts.alpha, experts.limit
        self.prefix = prefix


def mxfp4_slots(model: nn.Module, names: dict[Path, list[str]]) -> dict[str, Mxfp4Slot]:
    """Put an ``Mxfp4Slot`` in place of each experts module whose tensors the checkpoint
    (its tensor ``names``, by file) holds in MXFP4 blocks; returns them by module name.
    Their tensors, biases included, are then left to ``fill_mxfp4``."""
    modules = dict(model.named_modules())
    found: dict[str, str] = {}
    for held in names.values():
        for name in held:
            prefix, _, suffix = name.rpartition(".")
            if suffix not in SUFFIXES or suffix.endswith("_bias"):
                continue
            module_name = text_name(prefix)
            if not hasattr(modules.get(module_name), "gate_up_proj"):
                raise ValueError(f"{name}: MXFP4 blocks of no experts of the model")
            found[module_name] = prefix
    slots = {}
    for module_name, prefix in found.items():
        slots[module_name] = Mxfp4Slot(modules[module_name], prefix)
        parent, _, child = module_name.rpartition(".")
        setattr(modules[parent], child, slots[module_name])
    return slots


def slot_tensors(slots: dict[str, Mxfp4Slot]) -> set[str]:
    """The checkpoint tensors the slots' experts read themselves."""
    return {f"{slot.prefix}.{suffix}" for slot in slots.values() for suffix in SUFFIXES}


def fill_mxfp4(model: nn.Module, names: dict[Path, list[str]], slots: dict[str, Mxfp4Slot]) -> None:
    """Read each slot's experts (``read_mxfp4_experts``) and put them in its place."""
    where = {name: path for path, held in names.items() for name in held}
    modules = dict(model.named_modules())
    for module_name, slot in slots.items():
        experts = read_mxfp4_experts(where, slot.prefix, slot.shape, slot.alpha, slot.limit)
        parent, _, child = module_name.rpartition(".")
        setattr(modules[parent], child, experts)
