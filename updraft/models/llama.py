"""Llama-family decoder (Llama, Qwen2, Qwen3), read top to bottom.

The batch is flat: ``input_ids`` and ``positions`` are [num_tokens] over all requests,
and attention finds each request's context through ``AttentionMetadata``. q/k/v and
gate/up projections are fused into one matmul each; the loader fills their slices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from updraft.attention.metadata import AttentionMetadata
from updraft.attention.paged import AttentionParams, paged_attention
from updraft.config import ModelConfig
from updraft.models.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32, as the reference does, then return to the compute dtype.
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)


class FusedLinear(nn.Linear):
    """One matmul for several checkpoint projections stacked on the output dim."""

    def __init__(self, in_features: int, split_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(split_sizes), bias=bias)
        self.split_sizes = split_sizes


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, name: str) -> None:
        super().__init__()
        self.params = AttentionParams(layer=name)
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = FusedLinear(
            config.hidden_size, [q_size, kv_size, kv_size], bias=config.attention_bias
        )
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden).view(hidden.shape[0], -1, self.head_dim)
        num_qk_heads = self.num_heads + self.num_kv_heads
        if self.q_norm is None:
            # q and k rotate in one call: they are adjacent heads of the fused output.
            qk = apply_rotary(qkv[:, :num_qk_heads], *rotary)
        else:
            q = self.q_norm(qkv[:, : self.num_heads])
            k = self.k_norm(qkv[:, self.num_heads : num_qk_heads])
            qk = apply_rotary(torch.cat([q, k], dim=1), *rotary)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, num_qk_heads:]
        return self.o_proj(paged_attention(q, k, v, kv_cache, metadata, self.scale, self.params))


class MLP(nn.Module):
    """The gated SiLU MLP (also DeepSeek's dense layers and shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        size = intermediate_size
        self.gate_up_proj = FusedLinear(hidden_size, [size, size], bias=bias)
        self.down_proj = nn.Linear(size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, f"model.layers.{index}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rotary, kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Also serves Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm): they differ from
    Llama only in what ``ModelConfig`` switches on."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            config.rope, config.head_dim, max_positions or config.max_position_embeddings
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] after the final norm."""
        hidden = self.model.embed_tokens(input_ids)
        rotary = self.rotary.lookup(positions, hidden.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden = layer(hidden, rotary, kv_cache, metadata)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
