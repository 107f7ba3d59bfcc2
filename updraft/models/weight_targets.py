"""Where a checkpoint tensor goes in a model: the parameter (and the slice of it, for
fused projections and stacked experts) its name maps onto, and the real parameters that
replace a model's meta ones as they fill. Both loaders, of checkpoint directories
(``loader.py``) and of GGUF files (``gguf_loader.py``), place tensors through these."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from updraft.models.layers import FusedLinear

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
    # Qwen3.5's Gated DeltaNet: q/k/v channels, the output gate z, write rate b, decay a.
    "in_proj_qkv": (("in_proj", 0),),
    "in_proj_z": (("in_proj", 1),),
    "in_proj_b": (("in_proj", 2),),
    "in_proj_a": (("in_proj", 3),),
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
# names its mixture mlp, as Qwen3-MoE's checkpoints do. Qwen2-MoE's one shared expert is
# the model's shared_experts, as DeepSeek's are.
# gpt-oss's expert biases are named as its experts' parameters (``models/gpt_oss.py``).
RENAMED_MODULES = (
    (".block_sparse_moe.", ".mlp."),
    (".mlp.shared_expert.", ".mlp.shared_experts."),
    (".experts.gate_up_proj_bias", ".experts.gate_up_bias"),
    (".experts.down_proj_bias", ".experts.down_bias"),
)
# A multimodal checkpoint's text tower (Gemma 3: transformers 5's names, then the older
# ones) is served as the text model; its vision tower and projector are not read.
TEXT_TOWER_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def text_name(checkpoint_name: str) -> str:
    """A checkpoint tensor's name as the text model calls it."""
    for prefix, renamed in TEXT_TOWER_PREFIXES:
        if checkpoint_name.startswith(prefix):
            return renamed + checkpoint_name[len(prefix) :]
    return checkpoint_name


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


Slice = int | tuple[int, int]  # a fused slice; or (expert, part) of stacked experts


class LaidOut:
    """A checkpoint tensor already read and put in the layout of the parameter it fills
    (by its module's ``from_checkpoint(name, tensor)``), sliced as a safetensors slice
    is."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor:
        return self.tensor[index]


def is_split(module: nn.Module | None) -> bool:
    """Whether ``module``'s parameters stack several checkpoint projections."""
    return isinstance(module, FusedLinear) or getattr(module, "split_sizes", None) is not None


def target_of(
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
        # A fused projection without this slice (Gemma 4's q and k only, where values
        # are keys) has no place for the tensor.
        sizes = getattr(modules.get(f"{parent}.{fused}"), "split_sizes", None)
        if name in params and (sizes is None or index < len(sizes)):
            return name, index
    if checkpoint_name in params:
        module = modules.get(checkpoint_name.rpartition(".")[0])
        return checkpoint_name, FUSED if is_split(module) else 0
    if checkpoint_name == "lm_head.weight" and "lm_head.weight" not in params:
        return "model.embed_tokens.weight", -1  # tied: the checkpoint repeats the embedding
    return None


# A checkpoint tensor's place in the model: one slice, or for a checkpoint that fuses
# the projections itself (Phi-3's qkv_proj, gate_up_proj) every slice of the fused
# parameter, each at its row offset in the tensor.
FUSED = -2


def part_of(param: torch.Tensor, module: nn.Module, name: str, index: Slice) -> torch.Tensor:
    """The slice ``index`` of ``param`` (held by ``module`` as ``name``)."""
    if isinstance(index, tuple):  # one expert's gate, up or down rows
        expert, part = index
        param = param[expert]
        if name.endswith("gate_up_proj"):
            half = param.shape[0] // 2
            param = param.narrow(0, part * half, half)
    elif is_split(module):
        start = sum(module.split_sizes[:index])
        param = param.narrow(0, start, module.split_sizes[index])
    return param


class MadeParameters:
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

    def adopt(self, param: nn.Parameter, tensor: torch.Tensor) -> None:
        """Make the meta ``param`` ``tensor`` itself, not a copy of it (a whole weight
        that the checkpoint's map holds as the model keeps it)."""
        real = nn.Parameter(tensor, requires_grad=False)
        for module, name in self.holders[id(param)]:
            setattr(module, name, real)
        self.real[id(param)] = real

    def check(self) -> None:
        left = [name for name, param in self.model.named_parameters() if param.is_meta]
        if left:
            raise ValueError(f"parameters no checkpoint tensor filled: {left[:8]}")
