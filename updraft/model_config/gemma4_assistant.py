"""Gemma 4's assistant drafter's config: a Gemma 4 text model (``text_config``) whose
every layer reads the target's K/V, between a projection from and back to the target's
width (``backbone_hidden_size``), with an LM head that may score only the tokens of a
few clusters (``use_ordered_embeddings``: ``num_centroids``, of which the
``centroid_intermediate_top_k`` best are kept per row).

What transformers checks of such a config is checked here too, with the field named:
no per-layer inputs, no MoE block, no double-wide MLP, every layer KV-shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from updraft.model_config.fields import LAYER_TYPES, dtype_name, positive_int, rope_config
from updraft.model_config.parts import RopeConfig

# What a published config leaves out takes transformers' defaults.
TEXT_DEFAULTS = {
    "head_dim": 256,
    "global_head_dim": 512,
    "sliding_window": 512,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "tie_word_embeddings": True,
}
ASSISTANT_DEFAULTS = {
    "backbone_hidden_size": 1536,
    "use_ordered_embeddings": False,
    "num_centroids": 2048,
    "centroid_intermediate_top_k": 32,
}
DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
    },
}


@dataclass(frozen=True)
class AssistantConfig:
    vocab_size: int
    hidden_size: int
    backbone_hidden_size: int  # the target's width: the hidden states it reads and makes
    intermediate_size: int
    num_heads: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]  # sliding_attention | full_attention, per layer
    head_dims: tuple[int, ...]  # per layer
    sliding_window: int  # transformers' window of the assistant's sliding layers
    rope: dict[str, RopeConfig]  # by layer kind, as the target's
    max_position_embeddings: int
    tie_word_embeddings: bool
    use_ordered_embeddings: bool
    num_centroids: int
    centroid_intermediate_top_k: int

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def tokens_per_centroid(self) -> int:
        return self.vocab_size // self.num_centroids


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The assistant's text model's config, with transformers' defaults where it is
    silent, checked as transformers checks it."""
    given = raw.get("text_config")
    if not isinstance(given, dict):
        raise ValueError("config.json: the Gemma 4 assistant lacks its text_config")
    text = {**TEXT_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        if text.get(key):
            raise ValueError(f"config.json: text_config.{key} must be 0, got {text[key]!r}")
    for key in ("enable_moe_block", "use_double_wide_mlp"):
        if text.get(key):
            raise ValueError(f"config.json: text_config.{key} must be false, got {text[key]!r}")
    layers = positive_int(text, "num_hidden_layers")
    shared = text.get("num_kv_shared_layers") or layers  # transformers fills in every layer
    if shared != layers:
        raise ValueError(
            f"config.json: every layer of a Gemma 4 assistant reads the target's K/V "
            f"(num_kv_shared_layers = num_hidden_layers = {layers}), got {shared}"
        )
    if text["hidden_activation"] != "gelu_pytorch_tanh":
        raise ValueError(
            f"config.json: text_config.hidden_activation {text['hidden_activation']!r} is not "
            "supported (gelu_pytorch_tanh is)"
        )
    if text.get("use_bidirectional_attention") == "all":
        # transformers narrows the window so, for its attention kernels' exclusive bounds
        text["sliding_window"] = positive_int(text, "sliding_window") // 2 + 1
    return text


def layer_types(text: dict[str, Any]) -> tuple[str, ...]:
    layers = positive_int(text, "num_hidden_layers")
    kinds = text.get("layer_types") or [
        "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)
    ]
    if len(kinds) != layers or not set(kinds) <= set(LAYER_TYPES):
        raise ValueError(
            f"config.json: text_config.layer_types must list {layers} of {LAYER_TYPES}, "
            f"got {kinds!r}"
        )
    return (*kinds[:-1], "full_attention")  # transformers forces the last layer full


def head_dims(text: dict[str, Any], kinds: tuple[str, ...]) -> tuple[int, ...]:
    """Each layer's head size, as transformers reads it: from ``per_layer_config`` where
    the config has one (a layer it leaves out has ``head_dim``), else ``global_head_dim``
    for full layers."""
    per_layer = text.get("per_layer_config")
    dims = []
    for layer, kind in enumerate(kinds):
        if per_layer is not None:
            override = per_layer.get(str(layer)) or per_layer.get(layer) or {}
            dims.append(override.get("head_dim", text["head_dim"]))
        else:
            dims.append(text["global_head_dim"] if kind == "full_attention" else text["head_dim"])
    if not all(isinstance(d, int) and d > 0 and d % 2 == 0 for d in dims):
        raise ValueError(f"config.json: text_config head sizes must be even ints, got {dims}")
    return tuple(dims)


def layer_rope(text: dict[str, Any], kinds: tuple[str, ...]) -> dict[str, RopeConfig]:
    """Each layer kind's RoPE (transformers nests them by kind): the target's, which
    turned the keys the assistant's queries meet."""
    params = text.get("rope_parameters") or DEFAULT_ROPE
    ropes = {}
    for kind in sorted(set(kinds)):
        given = params.get(kind)
        if not isinstance(given, dict):
            raise ValueError(f"config.json: text_config.rope_parameters lacks {kind!r}")
        ropes[kind] = rope_config({"rope_parameters": given})
    return ropes


def assistant_config(raw: dict[str, Any]) -> AssistantConfig:
    """The assistant's config.json, checked."""
    text = text_config(raw)
    top = {**ASSISTANT_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    kinds = layer_types(text)
    config = AssistantConfig(
        vocab_size=positive_int(text, "vocab_size"),
        hidden_size=positive_int(text, "hidden_size"),
        backbone_hidden_size=positive_int(top, "backbone_hidden_size"),
        intermediate_size=positive_int(text, "intermediate_size"),
        num_heads=positive_int(text, "num_attention_heads"),
        rms_norm_eps=float(text["rms_norm_eps"]),
        layer_types=kinds,
        head_dims=head_dims(text, kinds),
        sliding_window=positive_int(text, "sliding_window"),
        rope=layer_rope(text, kinds),
        max_position_embeddings=positive_int(text, "max_position_embeddings"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        use_ordered_embeddings=bool(top["use_ordered_embeddings"]),
        num_centroids=positive_int(top, "num_centroids"),
        centroid_intermediate_top_k=positive_int(top, "centroid_intermediate_top_k"),
    )
    if config.use_ordered_embeddings:
        if config.vocab_size % config.num_centroids:
            raise ValueError(
                f"config.json: vocab_size {config.vocab_size} is not a multiple of "
                f"num_centroids {config.num_centroids}"
            )
        if config.centroid_intermediate_top_k > config.num_centroids:
            raise ValueError(
                f"config.json: centroid_intermediate_top_k {config.centroid_intermediate_top_k} "
                f"is more than num_centroids {config.num_centroids}"
            )
    return config


def parse(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """``ModelConfig`` fields of the assistant's text model (its layers and widths; what
    only the assistant has is ``assistant_config``'s)."""
    config = assistant_config(raw)
    text = text_config(raw)
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_layers": config.num_layers,
        "num_heads": config.num_heads,
        "num_kv_heads": text.get("num_key_value_heads") or config.num_heads,
        "head_dim": text["head_dim"],
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope": config.rope["full_attention"],
        "local_rope": config.rope.get("sliding_attention"),
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "qk_norm": True,
        "checkpoint_dtype": dtype_name(raw.get("torch_dtype") or raw.get("dtype")),
        "hidden_act": "gelu_pytorch_tanh",
        "layer_windows": tuple(
            config.sliding_window if kind == "sliding_attention" else None
            for kind in config.layer_types
        ),
    }
