"""A loaded model's weights put into the format they are kept in, for float32 compute on
the CPU.

A model is built and loaded in the dtype its weights arrive in (``storage_dtype``: a
bfloat16 checkpoint kept in bfloat16 loads as bfloat16, never through float32), then
``pack_model`` makes it run in float32: every linear layer and the routed experts are
packed into the weight format (``PackedLinear``, ``PackedExperts``), the embedding table
stays as loaded and widens the rows it looks up, and every other parameter (norms,
biases, the router, DeepSeek's absorbed ``kv_b_proj``, which is read as a matrix inside
attention rather than called as a layer) becomes float32.
"""

from __future__ import annotations

import torch
from torch import nn

from updraft.config import ModelConfig, WeightFormat, torch_dtype
from updraft.models.moe import Experts, PackedExperts
from updraft.models.packed_linear import can_pack, pack_linears
from updraft.models.tensor_parallel import VocabParallelEmbedding


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


def pack_model(model: nn.Module, fmt: WeightFormat, compute: torch.dtype) -> None:
    """Pack, in place, the linears and experts of a loaded ``model`` into ``fmt`` and
    give every other parameter the compute dtype, an embedding table excepted."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Experts):
                setattr(module, name, PackedExperts(child, fmt))
            elif isinstance(child, EMBEDDINGS) and child.weight.dtype != compute:
                setattr(module, name, WidenedEmbedding(child, compute))
    pack_linears(model, fmt)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, EMBEDDINGS)}
    for param in model.parameters():
        if id(param) not in tables and param.is_floating_point() and param.dtype != compute:
            param.data = param.data.to(compute)


def finish_loading(
    model: nn.Module, fmt: WeightFormat, device: torch.device | str, compute: torch.dtype
) -> nn.Module:
    """The loaded ``model`` ready to run: packed where it computes in float32 on the
    CPU; elsewhere its weights must be in the compute dtype already."""
    if can_pack(torch.device(device), compute, fmt):
        pack_model(model, fmt, compute)
    elif fmt != WeightFormat.of(compute):
        raise ValueError(
            f"{fmt} weights run on the CPU with float32 compute, not on {device} in "
            f"{str(compute).removeprefix('torch.')}"
        )
    return model.eval().requires_grad_(False)
