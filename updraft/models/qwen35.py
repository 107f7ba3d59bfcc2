"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next: a hybrid decoder whose layers are mostly Gated
DeltaNet (linear attention over a per-request state, ``gated_delta_net.py``), with a
full-attention layer every few (Llama's attention with per-head q/k norm, partial RoPE
and its output gated by sigmoid of q_proj's second half). Norms scale by (1 + weight).
The MLP is dense (Qwen3.5) or a softmax top-k mixture with one shared expert gated by a
sigmoid (Qwen3.5-MoE, and Qwen3-Next where its config puts experts).

Each layer's entry of ``kv_caches`` is its paged KV cache (full attention) or its
state tensor (linear); ``state_slots`` says which slot of the state each request owns.
Qwen3-Next's checkpoints store the DeltaNet projections interleaved per key head; its
layers split them into Qwen3.5's order after the matmul, and run the same code on.
"""

from __future__ import annotations

import torch
from torch import nn

from updraft.attention.metadata import AttentionMetadata
from updraft.model_config import ModelConfig
from updraft.models.gated_delta_net import GatedDeltaNet
from updraft.models.layers import MLP, CausalLM, norm
from updraft.models.llama import Attention
from updraft.models.moe import SparseMoE

INTERLEAVED = ("Qwen3NextForCausalLM",)


class HybridDecoderLayer(nn.Module):
    """Pre-norm token mixer (``linear_attn`` or ``self_attn``, as checkpoints name them)
    then pre-norm MLP or experts, each with its residual."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.is_linear = config.is_linear(index)
        self.input_layernorm = norm(config, config.hidden_size)
        if self.is_linear:
            interleaved = config.architecture in INTERLEAVED
            self.linear_attn = GatedDeltaNet(config, interleaved)
        else:
            self.self_attn = Attention(config, f"model.layers.{index}.self_attn")
        self.post_attention_layernorm = norm(config, config.hidden_size)
        if config.has_experts(index):
            self.mlp = SparseMoE(config.moe)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        cache: torch.Tensor,
        metadata: AttentionMetadata,
        state_slots: torch.Tensor | None,
    ) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        if self.is_linear:
            if state_slots is None:
                raise ValueError("a linear-attention layer needs the step's state_slots")
            mixed = self.linear_attn(normed, cache, state_slots, metadata)
        else:
            mixed = self.self_attn(normed, rotary, cache, metadata)
        hidden = hidden + mixed
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen35ForCausalLM(CausalLM):
    """Also the text tower of Qwen3.5's multimodal checkpoints, whose tensors the
    loader renames onto these."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(config, HybridDecoderLayer, config.rotary_dim, max_positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        rotary_rows: torch.Tensor | None = None,
        state_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] after the final norm; ``state_slots``
        [num_reqs]: each request's slot of the linear layers' state (-1: the spare)."""
        hidden = self.embed(input_ids)
        rows = positions if rotary_rows is None else rotary_rows
        rotary = self.rotary.lookup(rows, hidden.dtype)
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            hidden = layer(hidden, rotary, cache, metadata, state_slots)
        return self.model.norm(hidden)
