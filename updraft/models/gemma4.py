"""Gemma 4's text decoder (Gemma4ForCausalLM, and the text tower of the multimodal model).

Gemma 3's arrangement (norms after each sublayer too, GELU-tanh MLP, scaled embeddings,
capped logits) with these differences, each switched on by ``ModelConfig``:

* norms scale by their weight (not 1 + weight), always in float32; queries, keys and
  values are each normed per head (values without a weight) and the attention scale
  is 1;
* sliding layers turn RoPE with their own base over ``head_dim``; full layers have
  their own head size and KV heads and proportional RoPE (``rope.py``), and with
  ``attention_k_eq_v`` no value projection: values are the keys before their norm and
  RoPE, normed as values;
* the last ``num_kv_shared_layers`` layers project queries only and attend over the
  cache of the last writing layer of their kind (``ModelConfig.kv_source``), whose
  tensor is theirs too (``attention/cache_groups.py``); their MLPs may be twice as wide;
* per-layer inputs: each token's row of a large table (mapped, not loaded:
  ``mapped_table.py``) plus a projection of its embedding, one slice per layer, which
  each layer gates into its residual stream after the MLP;
* each layer's output is scaled by its ``layer_scalar``;
* with ``enable_moe_block`` (``ModelConfig.moe``), routed experts beside the MLP, fed
  and routed from the MLP's input before its norm, each output normed before the two
  are summed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from updraft.attention.context_parallel import attention
from updraft.attention.gqa import PagedKV, paged_attention
from updraft.attention.metadata import AttentionMetadata
from updraft.model_config import ModelConfig
from updraft.models.gemma import Gemma3ForCausalLM
from updraft.models.layers import ACTIVATIONS, MLP, CausalLM, FusedLinear, Matrix
from updraft.models.mapped_table import MappedEmbedding, rounded
from updraft.models.moe import Experts
from updraft.models.rope import RotaryEmbedding, apply_rotary

PER_LAYER_TABLE = "model.embed_tokens_per_layer.weight"


class Gemma4Norm(nn.Module):
    """RMSNorm in float32, scaled by its weight (``scaled``) or not at all."""

    def __init__(self, size: int, eps: float, scaled: bool = True) -> None:
        super().__init__()
        self.size, self.eps = size, eps
        self.weight = nn.Parameter(torch.ones(size)) if scaled else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (self.size,), eps=self.eps)
        if self.weight is not None:
            normed = normed * self.weight.float()
        return normed.to(x.dtype)


class Gemma4Attention(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.layer = f"model.layers.{index}.self_attn"  # its key as a captured task
        self.window = config.window(index)
        self.num_heads = config.num_heads
        self.num_kv_heads = config.layer_kv_heads(index)
        self.head_dim = head_dim = config.layer_head_dim(index)
        self.shares_kv = config.kv_source(index) != index
        self.keys_are_values = config.attention_k_eq_v and self.window is None
        eps, hidden = config.rms_norm_eps, config.hidden_size
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        if self.shares_kv:
            self.q_proj = nn.Linear(hidden, q_size, bias=False)
        else:
            sizes = [q_size, kv_size] if self.keys_are_values else [q_size, kv_size, kv_size]
            self.qkv_proj = FusedLinear(hidden, sizes, bias=False)
            self.k_norm = Gemma4Norm(head_dim, eps)
            self.v_norm = Gemma4Norm(head_dim, eps, scaled=False)
        self.q_norm = Gemma4Norm(head_dim, eps)
        self.o_proj = nn.Linear(q_size, hidden, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        tokens, heads = hidden.shape[0], self.num_heads
        if self.shares_kv:  # the source layer wrote this step's KV already
            return queries_over_cache(self, hidden, rotary, kv_cache, metadata)
        qkv = self.qkv_proj(hidden).view(tokens, -1, self.head_dim)
        keys = qkv[:, heads : heads + self.num_kv_heads]
        values = keys if self.keys_are_values else qkv[:, heads + self.num_kv_heads :]
        qk = torch.cat([self.q_norm(qkv[:, :heads]), self.k_norm(keys)], dim=1)
        qk = apply_rotary(qk, *rotary)
        attended = paged_attention(
            qk[:, :heads],
            qk[:, heads:],
            self.v_norm(values),
            kv_cache,
            metadata,
            1.0,
            self.layer,
            self.window,
        )
        return self.o_proj(attended)


def queries_over_cache(
    layer: nn.Module,
    hidden: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """The attention of a layer that has queries only (a KV-shared layer, the assistant
    drafter's) over K/V another layer wrote: its q_proj, q_norm and RoPE, then o_proj.
    ``layer`` holds those, ``num_heads``, its task key ``layer`` and its ``window``.
    Gemma 4 scales the scores by its q and k norms alone."""
    query = layer.q_norm(layer.q_proj(hidden).view(hidden.shape[0], layer.num_heads, -1))
    query = apply_rotary(query, *rotary)
    reader = PagedKV(query, kv_cache, 1.0)
    return layer.o_proj(attention(reader, metadata, layer.layer, window=layer.window))


class Gemma4Router(nn.Module):
    """The input normed without a weight, scaled by ``scale`` and hidden_size ** -0.5,
    projected to a softmax over the experts; the top k renormalised to sum to 1, each
    then scaled by its expert's ``per_expert_scale``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe, hidden = config.moe, config.hidden_size
        self.top_k = moe.num_experts_per_tok
        self.norm = Gemma4Norm(hidden, config.rms_norm_eps, scaled=False)
        # applied as it is: a panel's other summation order could change which experts
        # win a near-tie
        self.proj = Matrix(moe.num_experts, hidden)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(moe.num_experts))
        self.root = hidden**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, experts [T, k] int64)."""
        scaled = self.norm(x) * self.scale.to(x.dtype) * self.root
        scores = F.linear(scaled, self.proj.weight.to(x.dtype)).softmax(-1, dtype=torch.float32)
        weights, experts = scores.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale.index_select(0, experts.flatten()).view_as(
            weights
        ), experts


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = Gemma4Norm(hidden, eps)
        self.self_attn = Gemma4Attention(config, index)
        self.post_attention_layernorm = Gemma4Norm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4Norm(hidden, eps)
        wide = config.double_wide_mlp and config.kv_source(index) != index
        size = config.intermediate_size * (2 if wide else 1)
        self.mlp = MLP(hidden, size, activation=config.hidden_act)
        self.post_feedforward_layernorm = Gemma4Norm(hidden, eps)
        self.has_experts = config.moe is not None
        if self.has_experts:
            self.router = Gemma4Router(config)
            self.experts = Experts(config.moe)
            self.pre_feedforward_layernorm_2 = Gemma4Norm(hidden, eps)
            self.post_feedforward_layernorm_1 = Gemma4Norm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4Norm(hidden, eps)
        self.per_layer_input_size = per_layer = config.per_layer_input_size
        if per_layer:
            self.activation = ACTIVATIONS[config.hidden_act]
            self.per_layer_input_gate = nn.Linear(hidden, per_layer, bias=False)
            self.per_layer_projection = nn.Linear(per_layer, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4Norm(hidden, eps)
        # A parameter, not a buffer: checkpoints carry it, and the loader fills parameters.
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(
        self,
        hidden: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), rotary, kv_cache, metadata)
        hidden = hidden + self.post_attention_layernorm(attended)
        mixed = self.mlp(self.pre_feedforward_layernorm(hidden))
        if self.has_experts:
            weights, chosen = self.router(hidden)
            routed = self.experts(self.pre_feedforward_layernorm_2(hidden), weights, chosen)
            mixed = self.post_feedforward_layernorm_1(mixed)
            mixed = mixed + self.post_feedforward_layernorm_2(routed)
        hidden = hidden + self.post_feedforward_layernorm(mixed)
        if self.per_layer_input_size:
            gated = self.activation(self.per_layer_input_gate(hidden)) * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden * self.layer_scalar.to(hidden.dtype)


class Gemma4ForCausalLM(CausalLM):
    """Also the text tower of Gemma4ForConditionalGeneration, whose tensors the loader
    renames onto these (its vision and audio towers are not read)."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        full_head_dim = config.full_head_dim or config.head_dim
        super().__init__(config, Gemma4DecoderLayer, full_head_dim, max_positions)
        self.model.norm = Gemma4Norm(config.hidden_size, config.rms_norm_eps)
        self.local_rotary = RotaryEmbedding(
            config.local_rope or config.rope,
            config.head_dim,
            max_positions or config.max_position_embeddings,
        )
        self.multipliers = rounded(config.embedding_multiplier)
        self.per_layer_input_size = per_layer = config.per_layer_input_size
        if per_layer:
            layers, hidden = config.num_layers, config.hidden_size
            self.model.embed_tokens_per_layer = MappedEmbedding(
                PER_LAYER_TABLE, config.per_layer_vocab_size, layers * per_layer, per_layer**0.5
            )
            self.model.per_layer_model_projection = nn.Linear(hidden, layers * per_layer, False)
            self.model.per_layer_projection_norm = Gemma4Norm(per_layer, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        rotary_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] after the final norm."""
        hidden = self.embed(input_ids)
        per_layer_inputs = self.per_layer_inputs(input_ids, hidden)
        rows = positions if rotary_rows is None else rotary_rows
        rotaries = self.layer_rotaries(rows, hidden.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            per_layer = None if per_layer_inputs is None else per_layer_inputs[:, i]
            hidden = layer(hidden, per_layer, rotaries[i], kv_cache, metadata)
        return self.model.norm(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        return hidden * self.multipliers[hidden.dtype]

    def per_layer_inputs(
        self, input_ids: torch.Tensor, embedded: torch.Tensor
    ) -> torch.Tensor | None:
        """[T, layers, per_layer_input_size]: each token's table rows and the projection
        of its embedding, normed, averaged as (a + b) / sqrt(2)."""
        if not self.per_layer_input_size:
            return None
        model, shape = self.model, (embedded.shape[0], -1, self.per_layer_input_size)
        projected = model.per_layer_model_projection(embedded)
        projected = projected * self.config.hidden_size**-0.5
        projected = model.per_layer_projection_norm(projected.view(shape))
        looked_up = model.embed_tokens_per_layer(input_ids, embedded.dtype).view(shape)
        return (projected + looked_up) * 2.0**-0.5

    # The sliding layers' RoPE and the full layers' (proportional, over their own heads),
    # and the logits capped by a tanh, as Gemma 3's.
    layer_rotaries = Gemma3ForCausalLM.layer_rotaries
    compute_logits = Gemma3ForCausalLM.compute_logits

    def unused_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` (as the text model calls it) is one this
        model has no place for: a KV-shared layer's key and value projections and norms,
        which some checkpoints carry and the reference ignores too."""
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or parts[3] != "self_attn":
            return False
        layer = int(parts[2])
        shared = self.config.kv_source(layer) != layer
        return shared and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm")
