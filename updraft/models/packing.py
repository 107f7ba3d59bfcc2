"""A loaded model's weights put into the format they are kept in, for float32 compute on
the CPU.

A model is built on the meta device and filled in the dtype its weights arrive in
(``storage_dtype``: a bfloat16 checkpoint kept in bfloat16 loads as bfloat16, never
through float32). After each decoder layer fills, ``pack_model`` (through ``Packer``)
puts what is filled into the form it runs in for float32 compute: every linear layer
and the routed experts are packed into the weight format (``PackedLinear``,
``PackedExperts``, gpt-oss's with their biases), the embedding table stays as loaded
and widens the rows it looks up, and every other parameter (norms, biases, the router,
DeepSeek's absorbed ``kv_b_proj``, which is read as a matrix inside attention rather
than called as a layer) becomes float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from updraft.model_config import ModelConfig
from updraft.models.gpt_oss import GptOssExperts
from updraft.models.moe import Experts, PackedExperts
from updraft.models.packed_linear import can_pack, few_rows_for, pack_linears
from updraft.models.tensor_parallel import VocabParallelEmbedding
from updraft.weights import WeightFormat, torch_dtype


def storage_dtype(fmt: WeightFormat, compute: torch.dtype, config: ModelConfig) -> torch.dtype:
    """The dtype a model is built and loaded in: a float format's own; for a quantized
    one the checkpoint's (quantized from the values it holds); else the compute dtype."""
    if fmt.quantized:
        return torch_dtype(config.checkpoint_dtype)
    return torch_dtype(fmt.name)


class WidenedEmbedding(nn.Module):
    """An embedding whose table is kept in a narrower dtype than the compute dtype: the
    rows looked up are widened, the table never is."""

    def __init__(self, embedding: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.embedding = embedding
        self.dtype = dtype

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(input_ids).to(self.dtype)


EMBEDDINGS = (nn.Embedding, VocabParallelEmbedding)


def _loaded(module: nn.Module) -> bool:
    return not any(param.is_meta for param in module.parameters())


def pack_model(
    model: nn.Module,
    fmt: WeightFormat,
    compute: torch.dtype,
    few_rows: int | None = None,
    int8: bool = False,
    packed: Callable[[nn.Module], object] | None = None,
) -> None:
    """Pack, in place, the loaded linears and experts of ``model`` into ``fmt`` and give
    every other loaded parameter the compute dtype, an embedding table excepted. Parts
    still on the meta device are left for a later call, once their weights are in.
    ``int8``: activations rounded to int8 for the linears of a quantized ``fmt``
    (``models/grouped_linear.py``; experts keep their panels and float32 x). ``packed``:
    handed each linear and each layer's experts once replaced (a loader drops the file
    pages they were read from)."""
    for module in list(model.modules()):
        if isinstance(module, WidenedEmbedding):
            continue  # its table stays as it is
        for name, child in list(module.named_children()):
            if isinstance(child, Experts | GptOssExperts) and _loaded(child):
                setattr(module, name, PackedExperts.packed(child, fmt))
                if packed is not None:
                    packed(child)
            elif isinstance(child, EMBEDDINGS) and _loaded(child) and child.weight.dtype != compute:
                setattr(module, name, WidenedEmbedding(child, compute))
    pack_linears(model, fmt, few_rows, int8, packed)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, EMBEDDINGS)}
    for param in model.parameters():
        if id(param) in tables or param.is_meta or not param.is_floating_point():
            continue
        if param.dtype != compute:
            param.data = param.data.to(compute)


class Packer:
    """Packs a model as its loading goes (``packer(model)`` after each decoder layer's
    weights are in), so that a layer's weights in the checkpoint's dtype live only until
    the layer is packed. How many rows the panel kernel takes is decided once, from the
    whole model."""

    def __init__(self, fmt: WeightFormat, compute: torch.dtype, int8: bool = False) -> None:
        self.fmt = fmt
        self.compute = compute
        self.int8 = int8
        self.few_rows: int | None = None

    def __call__(self, model: nn.Module) -> None:
        if self.few_rows is None:
            self.few_rows = few_rows_for(model)
        pack_model(model, self.fmt, self.compute, self.few_rows, self.int8)


def packer(
    fmt: WeightFormat, device: torch.device | str, compute: torch.dtype, int8: bool = False
) -> Packer | None:
    """What packs a model computing in ``compute`` on ``device`` with weights in
    ``fmt`` as it loads (``int8``: with activations rounded to int8); None where its
    weights run as loaded. A format that cannot run there is refused by name."""
    if can_pack(torch.device(device), compute, fmt):
        return Packer(fmt, compute, int8)
    if fmt != WeightFormat.of(compute):
        raise ValueError(
            f"{fmt} weights run on the CPU with float32 compute, not on {device} in "
            f"{str(compute).removeprefix('torch.')}"
        )
    return None
