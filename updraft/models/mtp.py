"""DeepSeek's multi-token prediction (MTP) layers, as checkpoints store them after the
decoder layers (``model.layers.{num_hidden_layers + k}``).

Depth k predicts one token further than depth k - 1. Its input at position i is the
embedding of the token at i + 1 (from the main model's embedding) beside the hidden
state depth k - 1 had at i (the main model's final, normed hidden state for depth 0):

    h' = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])
    h' = one decoder block (latent attention over the layer's own cache, experts)
    h' = shared_head.norm(h')        -> logits through the main model's LM head,
                                        and the hidden state the next depth chains on

The layers are modules of their own, named as in the checkpoint, so ``load_mtp_layers``
fills them with the main loader, reading only their tensors. The first of them drafts
for ``--speculative-method mtp`` as a draft head (``models/draft_head.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from updraft.attention.metadata import AttentionMetadata
from updraft.model_config import ModelConfig
from updraft.models.deepseek import LatentAttention
from updraft.models.layers import DecoderLayer, RMSNorm
from updraft.models.loader import building, fill, weight_files
from updraft.models.moe import SparseMoE
from updraft.models.packing import storage_dtype
from updraft.models.tensor_parallel import shard_layers
from updraft.parallel.topology import RankPlace
from updraft.weights import WeightFormat

# Checkpoints repeat the main model's embedding and LM head inside each MTP layer; the
# layers share the main model's instead.
SHARED_WITH_MAIN = ("embed_tokens.weight", "shared_head.head.weight")


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """One depth: a DeepSeek decoder block (always with experts) and its input and
    output projections and norms."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        attention = LatentAttention(config, f"model.layers.{index}.self_attn")
        super().__init__(config, attention, SparseMoE(config.moe))
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)

    def forward(
        self,
        embeds: torch.Tensor,
        previous_hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """embeds [T, H] of the next tokens, previous_hidden [T, H] -> [T, H], normed;
        its one latent cache is ``kv_caches[0]``."""
        (cache,) = kv_caches
        hidden = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous_hidden)], dim=-1))
        return self.shared_head.norm(super().forward(hidden, rotary, cache, metadata))


class MTPLayers(nn.Module):
    """A checkpoint's MTP layers under their checkpoint names: ``model.layers.{N}``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        indices = range(config.num_layers, config.num_layers + config.mtp_layers)
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(i): MTPLayer(config, i) for i in indices})

    def depths(self) -> list[MTPLayer]:
        return list(self.model.layers.values())


def load_mtp_layers(
    config: ModelConfig,
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    weights: WeightFormat | None = None,
    place: RankPlace | None = None,
) -> MTPLayers:
    """The checkpoint's MTP layers, computing in ``dtype`` on ``device``, their weights
    in ``weights`` (default: the compute dtype); with ``place``, the shard of each that
    rank keeps, split like a target layer. A checkpoint whose config announces MTP
    layers it does not hold is an error that names the tensors."""
    if config.mla is None or config.mtp_layers < 1:
        raise ValueError(
            f"{config.architecture} checkpoint has no multi-token prediction layers "
            "(num_nextn_predict_layers)"
        )
    fmt = weights or WeightFormat.of(dtype)
    with building(storage_dtype(fmt, dtype, config), "meta"):
        layers = MTPLayers(config)
    first = config.num_layers
    prefixes = tuple(f"model.layers.{i}." for i in range(first, first + config.mtp_layers))
    return fill(
        layers,
        weight_files(Path(model_dir)),
        fmt,
        dtype,
        device,
        select=lambda name: name.startswith(prefixes) and not name.endswith(SHARED_WITH_MAIN),
        place=place,
        split=lambda layers, place: shard_layers(layers.depths(), place),
    )
