"""Gemma 3's text decoder: Llama's grouped-query attention (with q/k norm) and gated MLP,
arranged Gemma's way.

What sets it apart, each switched on by ``ModelConfig``:

* norms scale by (1 + weight), and each layer norms the attention's and the MLP's
  outputs too (post-attention, pre- and post-feed-forward norms);
* sliding layers (``layer_windows``) attend to their window and turn RoPE with their
  own base (``local_rope``); global layers with the model's;
* the attention scale is query_pre_attn_scalar ** -0.5; the MLP is GELU-tanh;
* embeddings are scaled by sqrt(hidden_size), and logits may be capped by a tanh.
"""

from __future__ import annotations

import torch

from updraft.attention.metadata import AttentionMetadata
from updraft.model_config import ModelConfig
from updraft.models.layers import MLP, CausalLM, DecoderLayer, norm
from updraft.models.llama import Attention
from updraft.models.rope import RotaryEmbedding


class GemmaDecoderLayer(DecoderLayer):
    """Each sublayer's output is normed before it joins the residual stream."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        window = config.window(index)
        attention = Attention(config, f"model.layers.{index}.self_attn", window)
        mlp = MLP(config.hidden_size, config.intermediate_size, activation=config.hidden_act)
        super().__init__(config, attention, mlp)
        self.pre_feedforward_layernorm = norm(config, config.hidden_size)
        self.post_feedforward_layernorm = norm(config, config.hidden_size)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), rotary, kv_cache, metadata)
        hidden = hidden + self.post_attention_layernorm(attended)
        mixed = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mixed)


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's text model; also the text tower of Gemma3ForConditionalGeneration,
    whose tensors the loader renames onto these."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(config, GemmaDecoderLayer, config.rotary_dim, max_positions)
        self.local_rotary = RotaryEmbedding(
            config.local_rope or config.rope,
            config.rotary_dim,
            max_positions or config.max_position_embeddings,
        )
        # The reference rounds the embedding multiplier to the compute dtype first.
        self.multipliers = {
            dtype: torch.tensor(config.embedding_multiplier, dtype=dtype, device="cpu").item()
            for dtype in (torch.float32, torch.bfloat16, torch.float16)
        }

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        return hidden * self.multipliers[hidden.dtype]

    def layer_rotaries(
        self, rows: torch.Tensor, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The sliding layers' own RoPE, the global layers' the model's."""
        full = self.rotary.lookup(rows, dtype)
        local = self.local_rotary.lookup(rows, dtype)
        windows = (self.config.window(index) for index in range(len(self.model.layers)))
        return [full if window is None else local for window in windows]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
