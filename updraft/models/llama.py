"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, and with experts Qwen3-MoE,
Mixtral and Qwen2-MoE): grouped-query attention over a paged cache, read top to bottom. q/k/v are
fused into one matmul (and gate/up, in ``layers.MLP``); the loader fills their slices.
A layer with a sliding window attends to the last ``window`` positions only.
"""

from __future__ import annotations

import torch
from torch import nn

from updraft.attention.gqa import paged_attention
from updraft.attention.metadata import AttentionMetadata
from updraft.model_config import ModelConfig
from updraft.models.layers import MLP, CausalLM, DecoderLayer, FusedLinear, norm
from updraft.models.moe import SparseMoE
from updraft.models.rope import apply_rotary


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, name: str, window: int | None = None) -> None:
        super().__init__()
        self.layer = name  # its key as a captured task (graph/tasks.py)
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale or config.head_dim**-0.5
        self.window = window
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        # Qwen3.5/Next: q_proj makes per head its query, then a gate of the same width.
        self.output_gate = config.attention_output_gate
        q_rows = 2 * q_size if self.output_gate else q_size
        self.qkv_proj = FusedLinear(
            config.hidden_size, [q_rows, kv_size, kv_size], bias=config.attention_bias
        )
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = norm(config, config.head_dim)
            self.k_norm = norm(config, config.head_dim)
        else:
            self.q_norm = self.k_norm = None
        self.sinks: nn.Parameter | None = None  # gpt-oss's: one logit per query head

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden).view(hidden.shape[0], -1, self.head_dim)
        gate = None
        if self.output_gate:
            query_gate = qkv[:, : 2 * self.num_heads].unflatten(1, (self.num_heads, 2))
            gate = query_gate[:, :, 1].flatten(1)
            qkv = torch.cat([query_gate[:, :, 0], qkv[:, 2 * self.num_heads :]], dim=1)
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
        attention = paged_attention(
            q, k, v, kv_cache, metadata, self.scale, self.layer, self.window, self.sinks
        )
        if gate is not None:
            attention = attention * torch.sigmoid(gate)
        return self.o_proj(attention)


def llama_layer(config: ModelConfig, index: int) -> DecoderLayer:
    attention = Attention(config, f"model.layers.{index}.self_attn", config.window(index))
    if config.has_experts(index):
        return DecoderLayer(config, attention, SparseMoE(config.moe))
    return DecoderLayer(
        config, attention, MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
    )


class LlamaForCausalLM(CausalLM):
    """Also serves Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm), Phi-3,
    Qwen3-MoE, Mixtral and Qwen2-MoE (experts in place of the MLP; Qwen2-MoE's with a
    gated shared expert): they differ from Llama only in what ``ModelConfig`` switches
    on."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(config, llama_layer, config.rotary_dim, max_positions)
