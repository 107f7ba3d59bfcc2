"""A GGUF file's stacked experts put into a model's routed experts, never widened.

llama.cpp stores each layer's routed experts as one tensor per projection, [experts,
rows, columns] (``STACKED``), beside the router and any shared experts (``NAMES``:
ordinary tensors, which ``gguf_loader`` places by their transformers names). Every
family whose experts live at ``model.layers.N.mlp`` (Qwen3-MoE, Qwen2-MoE, Mixtral,
DeepSeek: router ``gate``, routed ``experts``, ``shared_experts``) reads them alike, and
so does Gemma 4, whose experts live at ``model.layers.N.experts`` beside its dense MLP.
gpt-oss's experts (with a bias per projection) are placed by ``gguf_gpt_oss``. A
layer's experts become, by the types the file keeps them in:

* float (F32, F16, BF16): the model's stacked ``Experts`` parameters, packed like a
  safetensors checkpoint's (``PackedExperts`` in the file's float format);
* every projection Q8_0, or every one Q4_0: their codes and scales moved into int8 or
  int4 panels value for value (``gguf_panels``), run by ``updraft::grouped_mlp`` like
  any packed experts;
* any other block types (Q4_K_M's Q4_K and Q6_K among them): ``BlockExperts``, over the
  file's own blocks in its memory map, each chosen expert's rows through the block
  kernels (``updraft::gguf_grouped_mlp``).

Split over tensor-parallel ranks, a rank takes its share of every expert's rows out of
the file's map as it reads each stacked tensor (``gguf_shards.expert_share``), and its
experts take one of the forms above over those rows alone.

Under int8 activations (a quantized file's default), experts in blocks still take float
x: the integer kernels read linears only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

import updraft.kernels.gguf_grouped  # noqa: F401  (defines updraft::gguf_grouped_mlp)
from updraft.kernels.gguf_ops import BLOCK_TYPES, BLOCKS
from updraft.kernels.ops import EXPERT_ACTIVATIONS
from updraft.models.gguf_gpt_oss import gpt_oss_experts
from updraft.models.gguf_panels import PANEL_FORMATS, stacked_block_panels
from updraft.models.gguf_shards import RankShare
from updraft.models.gguf_tensors import FLOAT_DTYPES, block_rows, float_tensor
from updraft.models.gpt_oss import GptOssExperts
from updraft.models.moe import Experts, PackedExperts, RoutedExperts, expert_offsets
from updraft.models.read_pages import MappedSpans
from updraft.weights import WeightFormat

# A layer's stacked routed experts: which projection each tensor holds (gpt-oss's have
# a bias beside each).
STACKED = re.compile(
    r"blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate|up|gate_up|down)_exps\.(?P<part>weight|bias)"
)
EXPERTS_MODULE = "model.layers.{layer}.mlp.experts"
# Where else a layer's experts may live: beside its dense MLP (Gemma 4's).
OTHER_EXPERTS_MODULES = ("model.layers.{layer}.experts",)
# The tensors around them, as transformers' checkpoints of these families name them.
NAMES = (
    (r"blk\.(\d+)\.ffn_gate_inp\.weight", r"model.layers.\1.mlp.gate.weight"),
    (r"blk\.(\d+)\.exp_probs_b\.bias", r"model.layers.\1.mlp.gate.e_score_correction_bias"),
    (
        r"blk\.(\d+)\.ffn_(gate|up|down)_shexp\.weight",
        r"model.layers.\1.mlp.shared_experts.\2_proj.weight",
    ),
    (r"blk\.(\d+)\.ffn_gate_inp_shexp\.weight", r"model.layers.\1.mlp.shared_expert_gate.weight"),
)
# Routers and the shared expert's gate score in float32, as the references do: llama.cpp
# never quantizes them, and a file that did is refused rather than guessed at.
FLOAT_ONLY = re.compile(r"blk\.\d+\.(ffn_gate_inp|exp_probs_b|ffn_gate_inp_shexp)\.\w+")


def down_target(name: str) -> tuple[str, int] | None:
    """The parameter (and its part) that a stacked ``ffn_down_exps`` tensor ``name``
    fills, whose inputs a tensor-parallel rank splits; None for any other tensor."""
    match = STACKED.fullmatch(name)
    if match is None or match["proj"] != "down" or match["part"] != "weight":
        return None
    return f"{EXPERTS_MODULE.format(layer=match['layer'])}.down_proj", 0


@dataclass(frozen=True)
class Stacked:
    """One stacked expert tensor as the file holds it: floats [E, rows, columns], or
    blocks [E, rows, row_bytes] of ggml type ``kind``."""

    kind: str
    data: np.ndarray


class BlockExperts(RoutedExperts):
    """Routed experts whose stacked weights stay in the file's blocks: gate and up (one
    fused tensor [E, 2I, row_bytes], or two [E, I, row_bytes], each of its own type)
    and down [E, H, row_bytes]; the gate SiLU or (Gemma 4's) GELU-tanh."""

    def __init__(
        self,
        gate_up: list[torch.Tensor],
        gate_up_types: list[int],
        down: torch.Tensor,
        down_type: int,
        inter: int,
        activation: int = 0,
    ) -> None:
        super().__init__()
        self.num_experts = down.shape[0]
        self.activation = activation  # the gate's, as ``EXPERT_ACTIVATIONS`` indexes it
        self.gate_up_types = gate_up_types
        self.down_type = down_type
        self.inter = inter
        for index, part in enumerate(gate_up):
            self.register_buffer(f"gate_up{index}", part, persistent=False)
        self.register_buffer("down", down, persistent=False)

    def _grouped(
        self, rows: torch.Tensor, chosen: torch.Tensor, order: torch.Tensor
    ) -> torch.Tensor:
        parts = [getattr(self, f"gate_up{index}") for index in range(len(self.gate_up_types))]
        return torch.ops.updraft.gguf_grouped_mlp(
            rows,
            expert_offsets(chosen, self.num_experts),
            parts,
            self.gate_up_types,
            self.down,
            self.down_type,
            self.inter,
            activation=self.activation,
        )

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, in GGUF blocks"


class ExpertTensors:
    """Each layer's stacked expert tensors, collected while a file's tensors are read
    (``take``), then put in place of the model's experts (``place``)."""

    def __init__(
        self,
        modules: dict[str, nn.Module],
        file_name: str,
        share: RankShare,
        spans: MappedSpans | None = None,
    ) -> None:
        self.modules = modules
        self.file_name = file_name
        self.share = share  # what a tensor-parallel rank keeps of each tensor (or all)
        self.spans = spans  # the maps whose pages a layer's experts read are dropped
        self.layers: dict[str, dict[str, Stacked]] = {}

    def take(self, name: str, kind: str, data: np.ndarray) -> bool:
        """Keep ``name`` if it is a stacked expert tensor (True), else leave it."""
        if FLOAT_ONLY.fullmatch(name) and kind not in FLOAT_DTYPES:
            raise ValueError(f"{self.file_name}: {name} is in {kind} blocks; it is read as floats")
        match = STACKED.fullmatch(name)
        if match is None:
            return False
        module = self._module(match["layer"])
        if module is None:
            raise ValueError(f"{self.file_name}: GGUF tensor {name} fits no experts of the model")
        proj = match["proj"]
        if isinstance(self.modules[module], GptOssExperts):
            if self.share.ranks > 1:
                raise ValueError(f"{self.file_name}: gpt-oss's GGUF experts are read on one rank")
        elif match["part"] == "bias":
            raise ValueError(f"{self.file_name}: {name}: these experts have no biases")
        else:
            data = self.share.experts(name, kind, data, module, proj)
        key = proj if match["part"] == "weight" else f"{proj}.bias"
        self.layers.setdefault(module, {})[key] = Stacked(kind, data)
        return True

    def _module(self, layer: str) -> str | None:
        """The name of layer ``layer``'s routed experts in the model, if it has any."""
        for pattern in (EXPERTS_MODULE, *OTHER_EXPERTS_MODULES):
            module = pattern.format(layer=layer)
            if isinstance(self.modules.get(module), Experts | GptOssExperts):
                return module
        return None

    def place(self, under: str = "") -> None:
        """Put the experts read so far in the model: those of the module ``under`` (a
        decoder layer, as it is about to be packed), or all that are left. A float
        file's gate and up are joined in a copy here, so one layer's at a time."""
        chosen = [name for name in self.layers if not under or name.startswith(f"{under}.")]
        for module_name in chosen:
            parts = self.layers.pop(module_name)
            parent, _, child = module_name.rpartition(".")
            experts = self.modules[module_name]
            if isinstance(experts, GptOssExperts):
                held = {key: (part.kind, part.data) for key, part in parts.items()}
                routed = gpt_oss_experts(self.file_name, experts, held, module_name)
            else:
                routed = self._routed(experts, parts, module_name)
            setattr(self.modules[parent], child, routed)
            if self.spans is not None:  # read into panels or a joined copy: its pages go
                read = [block_rows(part.data) for part in parts.values()]
                self.spans.drop_unheld(read, self.modules[""])

    def _routed(self, experts: Experts, parts: dict[str, Stacked], where: str) -> nn.Module:
        """The routed experts of one layer, in the form its tensors' types allow."""
        gate_up_names = ["gate_up"] if "gate_up" in parts else ["gate", "up"]
        missing = [name for name in (*gate_up_names, "down") if name not in parts]
        if missing:
            raise ValueError(f"{self.file_name}: {where} has no ffn_{missing[0]}_exps tensor")
        gate_up, down = [parts[name] for name in gate_up_names], parts["down"]
        num_experts, rows, hidden = experts.gate_up_proj.shape
        inter = experts.down_proj.shape[2]
        kinds = {part.kind for part in (*gate_up, down)}
        if kinds <= FLOAT_DTYPES.keys():
            gate_up_proj = torch.cat([_float(part) for part in gate_up], dim=1)
            self._check(where, "gate and up", gate_up_proj.shape, (num_experts, rows, hidden))
            self._check(where, "down", _float(down).shape, (num_experts, hidden, inter))
            experts.gate_up_proj = nn.Parameter(gate_up_proj, requires_grad=False)
            experts.down_proj = nn.Parameter(_float(down), requires_grad=False)
            return experts  # packed with the model's other float weights
        if kinds & FLOAT_DTYPES.keys():
            raise ValueError(
                f"{self.file_name}: {where} mixes float and block types ({sorted(kinds)})"
            )
        blocks = [_blocks(part) for part in gate_up]
        for part, block in zip(gate_up, blocks, strict=True):
            shape = (num_experts, rows // len(gate_up), _row_bytes(part.kind, hidden))
            self._check(where, "gate and up", tuple(block.shape), shape)
        down_blocks = _blocks(down)
        shape = (num_experts, hidden, _row_bytes(down.kind, inter))
        self._check(where, "down", tuple(down_blocks.shape), shape)
        codes = {BLOCK_TYPES[kind] for kind in kinds}
        if len(codes) == 1 and next(iter(codes)) in PANEL_FORMATS:
            fmt = PANEL_FORMATS[next(iter(codes))]
            per_expert = [[part[e] for part in blocks] for e in range(num_experts)]
            gate_up_panels = stacked_block_panels(per_expert, fmt, hidden)
            down_panels = stacked_block_panels([[d] for d in down_blocks], fmt, inter)
            fmt = WeightFormat(fmt, 32)
            return PackedExperts(gate_up_panels, down_panels, fmt, experts.activation)
        types = [BLOCK_TYPES[part.kind] for part in gate_up]
        gate = EXPERT_ACTIVATIONS.index(experts.activation)
        return BlockExperts(blocks, types, down_blocks, BLOCK_TYPES[down.kind], inter, gate)

    def _check(self, where: str, what: str, got: tuple, want: tuple) -> None:
        if tuple(got) != tuple(want):
            raise ValueError(
                f"{self.file_name}: {where}'s {what} tensors have shape {tuple(got)}, "
                f"the model's config wants {tuple(want)}"
            )


def _float(part: Stacked) -> torch.Tensor:
    return float_tensor(part.data, part.kind)


def _blocks(part: Stacked) -> torch.Tensor:
    if part.kind not in BLOCK_TYPES:
        raise ValueError(f"GGUF experts in {part.kind} blocks cannot be read")
    return block_rows(part.data)


def _row_bytes(kind: str, k: int) -> int:
    values, size = BLOCKS[BLOCK_TYPES[kind]]
    return k // values * size
