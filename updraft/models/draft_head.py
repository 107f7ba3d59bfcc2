"""Draft heads: small models that draft from a target's own hidden states, as one module
that a runner runs like any model (``forward`` and ``compute_logits``).

A head reads, at entry i, the embedding of the token at i + 1 beside the target's final
hidden state at i, and its output is the state the next draft step chains on. The
embedding and the LM head are the target's (shared, not copied: under tensor
parallelism the rank's vocabulary-parallel shards, whose forwards are collectives); the
body splits over the tensor ranks like a target layer of its kind. What tells the heads
apart is their body and where RoPE turns:

* DeepSeek's MTP layer (``models/mtp.py``): its decoder block over a latent cache, the
  target's rotary table, turned at i + 1 as transformers' ``MtpModel`` turns it;
* the hybrid Qwen families' MTP layer (``models/qwen35_mtp.py``): a full-attention layer
  of the model over a paged cache (the target's recurrent state is not the head's), the
  target's partial rotary table, turned at i as vLLM turns it (RoPE is relative: only
  the distances between entries count);
* an EAGLE-1 head (``models/eagle.py``): fc over [embedding ; state] and Llama decoder
  layers, with rotary tables of its own config, turned at i as EAGLE trains its heads.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from updraft.attention.metadata import AttentionMetadata
from updraft.model_config import ModelConfig
from updraft.models.eagle import eagle_config, load_eagle_head
from updraft.models.mtp import load_mtp_layers
from updraft.models.qwen35_mtp import keeps_mtp_apart, load_mtp_layer
from updraft.models.rope import RotaryEmbedding
from updraft.parallel.topology import RankPlace
from updraft.weights import WeightFormat


class DraftHead(nn.Module):
    def __init__(
        self, target: nn.Module, body: nn.Module, rotary: RotaryEmbedding, rope_offset: int
    ) -> None:
        """``body(embeds, features, rotary, kv_caches, metadata) -> hidden``; RoPE turns
        entry i at position i + ``rope_offset``."""
        super().__init__()
        # Registered here, so a capture of the head sees them as weights; run through
        # the target's own embed and compute_logits (Gemma scales the one, caps the other).
        self.embed_tokens = target.model.embed_tokens
        self.lm_head = target.lm_head
        self.target_embed = target.embed
        self.target_logits = target.compute_logits
        self.rotary = rotary
        self.rope_offset = rope_offset
        self.body = body

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        """Entries ``positions`` of the tokens ``input_ids`` (each one position on from
        its entry) beside ``hidden_states`` -> the head's hidden states."""
        rotary = self.rotary.lookup(positions + self.rope_offset, hidden_states.dtype)
        embeds = self.target_embed(input_ids)
        return self.body(embeds, hidden_states, rotary, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target_logits(hidden)


def mtp_head(
    target: nn.Module,
    config: ModelConfig,
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    place: RankPlace | None = None,
    weights: WeightFormat | None = None,
) -> tuple[DraftHead, ModelConfig]:
    """The checkpoint's first MTP layer as a head for ``target`` (whose config is
    ``config``), and the config its cache follows: the target's, with the one layer.
    With ``place``, the shard of the layer that rank keeps, split like a target layer."""
    if keeps_mtp_apart(config):
        body, layer_config = load_mtp_layer(config, model_dir, dtype, device, weights, place)
        return DraftHead(target, body, target.rotary, rope_offset=0), layer_config
    layer = load_mtp_layers(config, model_dir, dtype, device, weights, place).depths()[0]
    return DraftHead(target, layer, target.rotary, rope_offset=1), replace(config, num_layers=1)


def eagle_head(
    target: nn.Module,
    config: ModelConfig,
    head_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    place: RankPlace | None = None,
    weights: WeightFormat | None = None,
) -> tuple[DraftHead, ModelConfig]:
    """The EAGLE-1 head in ``head_dir`` for ``target`` (whose config is ``config``), and
    the head's own config; with ``place``, the shard of its layers that rank keeps."""
    head_config = eagle_config(head_dir, config)
    body = load_eagle_head(head_dir, head_config, dtype, device, place, weights)
    max_positions = target.rotary.cos.shape[0]
    with torch.device(device):
        rotary = RotaryEmbedding(head_config.rope, head_config.head_dim, max_positions)
    return DraftHead(target, body, rotary, rope_offset=0), head_config
