"""The multi-token prediction (MTP) layer of Qwen3.5, Qwen3.5-MoE and Qwen3-Next, which
their checkpoints keep apart from the decoder, under ``mtp.*``.

Its input at entry i is the embedding of the token at i + 1 (from the main model's
embedding) beside the main model's final, normed hidden state at i:

    h' = fc([pre_fc_norm_embedding(embed(t_{i+1})) ; pre_fc_norm_hidden(h_i)])
    h' = layers.0(h')      a full-attention decoder layer of the model (gated attention,
                           partial RoPE, experts in the MoE models) over its own paged cache
    h' = norm(h')          -> logits through the main model's LM head, and the state
                              the next draft step chains on

Norms scale by (1 + weight), as the model's do. The checkpoints hold no embedding or LM
head of the layer's own: it shares the main model's. A checkpoint with several MTP
layers drafts with the first. The layer drafts for ``--speculative-method mtp`` as a
draft head (``models/draft_head.py``); it keeps no recurrent state, so its runner's
cache is paged KV alone while the main model beside it keeps its state slots.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from updraft.attention.metadata import AttentionMetadata
from updraft.checkpoints.gguf import linked_files
from updraft.model_config import ModelConfig
from updraft.models.layers import norm
from updraft.models.loader import MTP_PREFIX, building, checkpoint_names, fill, weight_files
from updraft.models.packing import storage_dtype
from updraft.models.qwen35 import HybridDecoderLayer
from updraft.models.tensor_parallel import shard_layers
from updraft.parallel.topology import RankPlace
from updraft.weights import WeightFormat

FIRST_LAYER = f"{MTP_PREFIX}layers.0."


def keeps_mtp_apart(config: ModelConfig) -> bool:
    """Whether ``config``'s family stores its MTP layer under ``mtp.*`` (the hybrid
    Qwen families), rather than after its decoder layers as DeepSeek does."""
    return config.linear_attention is not None


def mtp_config(config: ModelConfig) -> ModelConfig:
    """The config of the MTP layer's cache and body: one full-attention layer, index 0
    of ``config`` (experts where its layer 0 has them), no recurrent state."""
    return replace(
        config,
        num_layers=1,
        linear_attention=None,
        linear_layers=frozenset(),
        dense_layers=config.dense_layers & {0},
        mtp_layers=0,
    )


class MTPLayer(nn.Module):
    """The layer's modules as the checkpoint names them below ``mtp.``."""

    def __init__(self, config: ModelConfig) -> None:
        """``config``: the layer's own (``mtp_config``)."""
        super().__init__()
        size = config.hidden_size
        self.fc = nn.Linear(2 * size, size, bias=False)
        self.pre_fc_norm_embedding = norm(config, size)
        self.pre_fc_norm_hidden = norm(config, size)
        self.layers = nn.ModuleList([HybridDecoderLayer(config, 0)])
        self.norm = norm(config, size)

    def forward(
        self,
        embeds: torch.Tensor,
        previous_hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """embeds [T, H] of the next tokens, previous_hidden [T, H] -> [T, H], normed;
        its one paged cache is ``kv_caches[0]``."""
        (cache,) = kv_caches
        joined = torch.cat(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(previous_hidden)], dim=-1
        )
        hidden = self.layers[0](self.fc(joined), rotary, cache, metadata, None)
        return self.norm(hidden)


class MTPCheckpoint(nn.Module):
    """The layer under its checkpoint name, so the main loader fills it."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.mtp = MTPLayer(config)


def load_mtp_layer(
    config: ModelConfig,
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    weights: WeightFormat | None = None,
    place: RankPlace | None = None,
) -> tuple[MTPLayer, ModelConfig]:
    """The checkpoint's first MTP layer, computing in ``dtype`` on ``device``, its
    weights in ``weights`` (default: the compute dtype), and its config (``config`` is
    the main model's); with ``place``, the shard that rank keeps, split like a target
    layer. The tensors decide, not the config (Qwen3-Next's announces no layer it
    holds); a checkpoint without them is refused by name."""
    if linked_files(Path(model_dir)) is not None:
        raise ValueError(
            f"{model_dir} is a GGUF file, whose multi-token prediction layer is not read: "
            "--speculative-method mtp needs the checkpoint directory (safetensors)"
        )
    files = weight_files(Path(model_dir))
    held = [name for names in checkpoint_names(files).values() for name in names]
    if not any(name.startswith(FIRST_LAYER) for name in held):
        listed = ", ".join(path.name for path in files)
        if config.mtp_layers < 1:
            raise ValueError(
                f"{config.architecture} checkpoint {model_dir} has no multi-token prediction "
                f"layers: no {FIRST_LAYER}* tensors in {listed}"
            )
        raise ValueError(
            f"{config.architecture} checkpoint {model_dir}: config.json announces "
            f"{config.mtp_layers} multi-token prediction layer(s) (mtp_num_hidden_layers), "
            f"but {listed} hold no {FIRST_LAYER}* tensors (a model saved by transformers "
            "loses them)"
        )
    layer_config = mtp_config(config)
    fmt = weights or WeightFormat.of(dtype)
    with building(storage_dtype(fmt, dtype, layer_config), "meta"):
        holder = MTPCheckpoint(layer_config)
    later_layers = f"{MTP_PREFIX}layers."
    filled = fill(
        holder,
        files,
        fmt,
        dtype,
        device,
        # Only the first layer drafts: any later ones stay on disk.
        select=lambda name: (
            name.startswith(MTP_PREFIX)
            and (name.startswith(FIRST_LAYER) or not name.startswith(later_layers))
        ),
        place=place,
        split=lambda holder, place: shard_layers(holder.mtp.layers, place),
    )
    return filled.mtp, layer_config
