"""DeepSeek-V2, V3 and V3.2 decoders: latent attention (MLA), DeepSeekMoE, and for V3.2
the sparse-attention indexer (DSA), read top to bottom.

The batch is flat, as in ``llama.py``. Each attention layer writes one row per token
into its latent cache (``attention/latent.py``): the normalised ``c_kv``, the rotated
shared key ``k_pe`` and, with an indexer, the indexer's key. Parameter names follow the
checkpoints, so the loader fills them by name; the query and latent down-projections,
which read the same input, are one fused matmul.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from updraft.attention.latent import LatentDims, latent_attention
from updraft.attention.metadata import AttentionMetadata
from updraft.model_config import MLAConfig, ModelConfig, RopeConfig
from updraft.models.layers import MLP, CausalLM, DecoderLayer, FusedLinear, Matrix, RMSNorm
from updraft.models.moe import SparseMoE
from updraft.models.rope import apply_rotary

# The latent norms' epsilon: the reference builds them with its default, not the
# config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def softmax_scale(mla: MLAConfig, rope: RopeConfig) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale squared when the config scales all
    dimensions (``mscale_all_dim``): the correction for the stretched context."""
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    if rope.kind != "default" and rope.mscale_all_dim and rope.factor > 1:
        mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= mscale * mscale
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary pairs stored as adjacent columns (x0, x1), (x2, x3), ... -> the
    rotate-half layout (x0, x2, ...; x1, x3, ...). Queries and keys are permuted alike,
    so their dot products are unchanged, and the cache holds the rotate-half layout."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class Indexer(nn.Module):
    """DSA's lightning indexer: per token a key of ``index_head_dim`` (LayerNorm'd, its
    first qk_rope_head_dim columns rotated) for the cache, and per query its heads'
    queries and weights."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        indexer, mla = config.indexer, config.mla
        self.n_heads, self.head_dim = indexer.n_heads, indexer.head_dim
        self.rope_dim = mla.qk_rope_head_dim
        self.wq_b = nn.Linear(mla.q_lora_rank, indexer.n_heads * indexer.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, indexer.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(indexer.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, indexer.n_heads, bias=False)

    def _rotate(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        turned, kept = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rotary(turned, *rotary), kept], dim=-1)

    def forward(
        self,
        hidden: torch.Tensor,
        q_latent: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> keys [T, index_head_dim] for the cache, queries [T, heads, index_head_dim]
        and head weights [T, heads]."""
        num_tokens = hidden.shape[0]
        query = self.wq_b(q_latent).view(num_tokens, self.n_heads, self.head_dim)
        key = self.k_norm(self.wk(hidden))[:, None]
        weights = self.weights_proj(hidden).float() * self.n_heads**-0.5
        return self._rotate(key, rotary)[:, 0], self._rotate(query, rotary), weights


class LatentAttention(nn.Module):
    def __init__(self, config: ModelConfig, name: str) -> None:
        super().__init__()
        mla = config.mla
        self.mla = mla
        self.layer = name  # its key as a captured task (graph/tasks.py)
        self.num_heads = config.num_heads
        self.qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        self.scale = softmax_scale(mla, config.rope)
        self.dims = LatentDims(
            kv_lora_rank=mla.kv_lora_rank,
            qk_nope_head_dim=mla.qk_nope_head_dim,
            qk_rope_head_dim=mla.qk_rope_head_dim,
            v_head_dim=mla.v_head_dim,
            index_head_dim=config.indexer.head_dim if config.indexer else 0,
            index_topk=config.indexer.topk if config.indexer else 0,
        )
        latent = mla.kv_lora_rank + mla.qk_rope_head_dim
        query = mla.q_lora_rank or config.num_heads * self.qk_head_dim
        # The loader fills slice 0 from q_a_proj (or q_proj) and 1 from kv_a_proj_with_mqa.
        self.down_sizes = [query, latent]
        self.qkv_a_proj = FusedLinear(config.hidden_size, self.down_sizes, bias=False)
        if mla.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(
                mla.q_lora_rank, config.num_heads * self.qk_head_dim, bias=False
            )
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Matrix(
            config.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank
        )
        self.o_proj = nn.Linear(config.num_heads * mla.v_head_dim, config.hidden_size, bias=False)
        self.indexer = Indexer(config) if config.indexer is not None else None

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        mla, num_tokens = self.mla, hidden.shape[0]
        query, latent = self.qkv_a_proj(hidden).split(self.down_sizes, dim=-1)
        q_latent = None
        if mla.q_lora_rank is not None:
            q_latent = self.q_a_layernorm(query)
            query = self.q_b_proj(q_latent)
        q_nope, q_pe = query.view(num_tokens, self.num_heads, self.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1
        )
        c_kv, k_pe = latent.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        k_pe = k_pe[:, None]
        if mla.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        rows = [self.kv_a_layernorm(c_kv), apply_rotary(k_pe, *rotary)[:, 0]]
        index_query = index_weights = None
        if self.indexer is not None:
            index_key, index_query, index_weights = self.indexer(hidden, q_latent, rotary)
            rows.append(index_key)
        out = latent_attention(
            torch.cat(rows, dim=-1),
            q_nope,
            apply_rotary(q_pe, *rotary),
            cache,
            metadata,
            self.kv_b_proj.weight,
            self.dims,
            self.scale,
            self.layer,
            index_query,
            index_weights,
        )
        return self.o_proj(out)


def deepseek_layer(config: ModelConfig, index: int) -> DecoderLayer:
    attention = LatentAttention(config, f"model.layers.{index}.self_attn")
    if not config.has_experts(index):
        return DecoderLayer(config, attention, MLP(config.hidden_size, config.intermediate_size))
    return DecoderLayer(config, attention, SparseMoE(config.moe))


class DeepseekForCausalLM(CausalLM):
    """DeepSeek-V2 and V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``) and,
    with an indexer, V3.2 (``DeepseekV32ForCausalLM``)."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(config, deepseek_layer, config.mla.qk_rope_head_dim, max_positions)
