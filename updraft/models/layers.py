"""What every decoder here is made of: RMSNorm, fused projections, the gated MLP, the
pre-norm residual block, and a causal LM over a flat batch.

A model is ``CausalLM`` with its own decoder layers: the batch is flat
(``input_ids`` and ``positions`` are [num_tokens] over all requests), each layer gets
the shared rotary tables, its own KV cache and the step's ``AttentionMetadata``, and the
result is the final hidden states; ``compute_logits`` applies the LM head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from updraft.attention.metadata import AttentionMetadata
from updraft.model_config import ModelConfig
from updraft.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    """RMSNorm scaling by its weight, or with ``offset`` 1 by (1 + weight) (Gemma's,
    which also scales in float32 before returning to the compute dtype)."""

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
            return (normed * (self.weight.float() + self.offset)).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32, as the reference does, then return to the compute dtype.
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Matrix(nn.Module):
    """A weight matrix read as it is rather than called as a layer (DeepSeek's absorbed
    attention splits one per head; a router's or an LM head's rows that must keep their
    summation order or be read row by row): not an ``nn.Linear``, so it is never
    repacked into panels."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features))


class FusedLinear(nn.Linear):
    """One matmul for several checkpoint projections stacked on the output dim."""

    def __init__(self, in_features: int, split_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(split_sizes), bias=bias)
        self.split_sizes = split_sizes


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class MLP(nn.Module):
    """The gated MLP: SiLU (also DeepSeek's dense layers and shared experts), or
    GELU-tanh (Gemma)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        size = intermediate_size
        self.gate_up_proj = FusedLinear(hidden_size, [size, size], bias=bias)
        self.down_proj = nn.Linear(size, hidden_size, bias=bias)
        self.activation = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.activation(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP (or experts), each with its residual."""

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = norm(config, config.hidden_size)
        self.self_attn = self_attn
        self.post_attention_layernorm = norm(config, config.hidden_size)
        self.mlp = mlp

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rotary, kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def norm(config: ModelConfig, size: int) -> RMSNorm:
    """The model's RMSNorm over ``size`` values."""
    return RMSNorm(size, config.rms_norm_eps, config.norm_offset)


def _meta_weight(config: ModelConfig) -> torch.Tensor | None:
    """The embedding's weight when the model is built on the meta device: given, so
    that ``nn.Embedding`` skips its random init, whose ``normal_`` on meta tensors
    imports torch's compiler stack (about 85 MiB and seconds at every start)."""
    if torch.get_default_device().type != "meta":
        return None
    return torch.empty(config.vocab_size, config.hidden_size)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=_meta_weight(config)
        )
        self.layers = nn.ModuleList(layers)
        self.norm = norm(config, config.hidden_size)


class CausalLM(nn.Module):
    """A decoder whose layer ``i`` is ``make_layer(config, i)``, with RoPE over
    ``rotary_dim`` dimensions. Parameter names are the checkpoints' (``model.layers.N``,
    ``lm_head``), so the loader fills them by name."""

    def __init__(
        self,
        config: ModelConfig,
        make_layer: Callable[[ModelConfig, int], nn.Module],
        rotary_dim: int,
        max_positions: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        layers = [make_layer(config, i) for i in range(config.num_layers)]
        self.model = DecoderModel(config, layers)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            config.rope, rotary_dim, max_positions or config.max_position_embeddings
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        rotary_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] after the final norm. ``rotary_rows``:
        the row of the rotary table each token reads, where it is not its position
        (LongRoPE: ``step/inputs.py`` ``RotarySwitch``)."""
        hidden = self.embed(input_ids)
        rows = positions if rotary_rows is None else rotary_rows
        rotaries = self.layer_rotaries(rows, hidden.dtype)
        for layer, rotary, kv_cache in zip(self.model.layers, rotaries, kv_caches, strict=True):
            hidden = layer(hidden, rotary, kv_cache, metadata)
        return self.model.norm(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def layer_rotaries(
        self, rows: torch.Tensor, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos and sin at the tokens' ``rows``, looked up once per table."""
        return [self.rotary.lookup(rows, dtype)] * len(self.model.layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
