"""EAGLE-1 draft heads, as they are published: a directory with a one-layer Llama-family
``config.json`` and safetensors holding

    fc.weight [H, 2H] (and fc.bias, when the head has one)
    layers.N.*                       (Llama decoder layers; layer 0 has no input norm)
    embed_tokens.weight, lm_head.*   (optional copies of the target's: not read)

The head reads the embedding of token i + 1 beside the target's final hidden state at
i, and its output is its guess at the target's hidden state at i + 1:

    h = fc([embed(t_{i+1}) ; f_i])  ->  decoder layers  ->  h (no final norm)

The embedding and the LM head are the target's. EAGLE-3 heads (features from three
target layers, a draft vocabulary of their own) are refused by name: their layer reads
a 2H-wide input, a second shape of decoder layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from updraft.attention.metadata import AttentionMetadata
from updraft.model_config import ModelConfig
from updraft.model_config.registry import ARCHITECTURES
from updraft.models.layers import MLP, DecoderLayer
from updraft.models.llama import Attention
from updraft.models.loader import building, checkpoint_names, fill, weight_files
from updraft.models.packing import storage_dtype
from updraft.models.tensor_parallel import shard_layers
from updraft.parallel.topology import RankPlace
from updraft.weights import WeightFormat

SHARED_WITH_TARGET = ("embed_tokens.", "lm_head.")


class EagleHead(nn.Module):
    def __init__(self, config: ModelConfig, fc_bias: bool, first_input_norm: bool) -> None:
        super().__init__()
        size = config.hidden_size
        self.fc = nn.Linear(2 * size, size, bias=fc_bias)
        self.layers = nn.ModuleList(
            DecoderLayer(
                config,
                Attention(config, f"eagle.layers.{i}.self_attn", config.window(i)),
                MLP(size, config.intermediate_size, config.mlp_bias),
            )
            for i in range(config.num_layers)
        )
        if not first_input_norm:
            self.layers[0].input_layernorm = nn.Identity()

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """embeds [T, H] of the next tokens, features [T, H] -> [T, H]."""
        hidden = self.fc(torch.cat([embeds, features], dim=-1))
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, rotary, kv_cache, metadata)
        return hidden


def eagle_config(head_dir: str | Path, target: ModelConfig) -> ModelConfig:
    """The head's config, checked against the target it drafts for."""
    try:
        raw = json.loads((Path(head_dir) / "config.json").read_text())
    except (OSError, ValueError):
        raw = {}  # ModelConfig.from_dir names what is missing or malformed
    if "draft_vocab_size" in raw or any("Eagle3" in a for a in raw.get("architectures") or []):
        raise ValueError(
            f"{head_dir} is an EAGLE-3 head (its own draft vocabulary, features from three "
            "target layers); updraft runs EAGLE-1 heads"
        )
    config = ModelConfig.from_dir(head_dir)
    if not ARCHITECTURES[config.architecture].eagle_head:
        raise ValueError(
            f"{head_dir}: an EAGLE head is a Llama-family layer, got {config.architecture}"
        )
    for name in ("hidden_size", "vocab_size"):
        if getattr(config, name) != getattr(target, name):
            raise ValueError(
                f"EAGLE head {head_dir} has {name} {getattr(config, name)}, the target "
                f"{getattr(target, name)}: a head reads the target's hidden states and "
                "shares its embedding and LM head"
            )
    return config


def load_eagle_head(
    head_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    place: RankPlace | None = None,
    weights: WeightFormat | None = None,
) -> EagleHead:
    """The head computing in ``dtype`` on ``device``, its weights in ``weights`` (default:
    the compute dtype), its fc
    bias and first input norm present exactly when the checkpoint holds them; with
    ``place``, the shard of its layers that rank keeps (fc is whole on every rank, like
    the residual stream)."""
    files = weight_files(Path(head_dir))
    names = {name for held in checkpoint_names(files).values() for name in held}
    weights = weights or WeightFormat.of(dtype)
    with building(storage_dtype(weights, dtype, config), "meta"):
        head = EagleHead(
            config,
            fc_bias="fc.bias" in names,
            first_input_norm="layers.0.input_layernorm.weight" in names,
        )
    return fill(
        head,
        files,
        weights,
        dtype,
        device,
        select=lambda name: not name.startswith(SHARED_WITH_TARGET),
        place=place,
        split=lambda head, place: shard_layers(head.layers, place),
    )
