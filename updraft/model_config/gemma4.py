"""Gemma 4's config: its text model, and the text tower of the multimodal one.

transformers 5 writes the full-attention layers' own head size and KV heads as
``per_layer_config`` overrides; published configs give them as ``global_head_dim`` and
``num_global_key_value_heads`` (the latter only for ``attention_k_eq_v`` models). Both
are read, and what a config leaves out takes transformers' Gemma4TextConfig defaults.
"""

from __future__ import annotations

from typing import Any

from updraft.model_config.fields import (
    LAYER_TYPES,
    decoder_fields,
    layer_windows,
    positive_int,
    rope_config,
)
from updraft.model_config.parts import MoEConfig

MULTIMODAL = "Gemma4ForConditionalGeneration"
SLIDING, FULL = LAYER_TYPES
GEMMA4_TEXT_DEFAULTS = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "sliding_window": 512,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
    "global_head_dim": 512,
}
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
# transformers' default pattern: in every 6 layers, all but the last slide.
WINDOW_PATTERN = 6


def parse(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """``ModelConfig`` fields of a Gemma 4 config.json."""
    text = _text_config(raw, architecture)
    layers = positive_int(text, "num_hidden_layers")
    kinds = text.get("layer_types") or [
        SLIDING if (layer + 1) % WINDOW_PATTERN else FULL for layer in range(layers)
    ]
    # As transformers does: the last layer attends to everything, whatever the config says.
    kinds = [*kinds[:-1], FULL] if isinstance(kinds, list) and kinds else kinds
    text = {**text, "layer_types": kinds}
    windows = layer_windows(text, lambda _: [])
    rope = _rope_parameters(text)
    fields = decoder_fields({**text, "rope_parameters": rope[FULL]})
    full_head_dim, full_kv_heads = _full_layer_heads(text, kinds)
    shared = _kv_shared_layers(text, kinds)
    fields |= {
        "qk_norm": True,
        "layer_windows": windows,
        "hidden_act": "gelu_pytorch_tanh",
        "attention_scale": 1.0,
        "local_rope": rope_config({**text, "rope_parameters": rope[SLIDING]}),
        "embedding_multiplier": float(fields["hidden_size"]) ** 0.5,
        "final_logit_softcapping": text.get("final_logit_softcapping"),
        "full_head_dim": full_head_dim,
        "full_kv_heads": full_kv_heads,
        "attention_k_eq_v": bool(text["attention_k_eq_v"]),
        "num_kv_shared_layers": shared,
        "double_wide_mlp": bool(text["use_double_wide_mlp"]) and shared > 0,
        "per_layer_input_size": text.get("hidden_size_per_layer_input") or 0,
        "partial_rotary_factor": 1.0,  # the full layers' RoPE is proportional (rope.py)
    }
    if fields["per_layer_input_size"]:
        fields["per_layer_vocab_size"] = positive_int(text, "vocab_size_per_layer_input")
    if text["enable_moe_block"]:
        fields["moe"] = _experts(text)
    return fields


def _text_config(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The text config with transformers' defaults where it is silent; what the text
    model does not build is refused by name."""
    given = raw
    if architecture == MULTIMODAL:
        given = raw.get("text_config")
        if not isinstance(given, dict):
            raise ValueError(f"config.json: {MULTIMODAL} lacks its text_config")
        # transformers ties the LM head by the outer config's word.
        dtype = given.get("torch_dtype") or raw.get("torch_dtype") or raw.get("dtype")
        tied = raw.get("tie_word_embeddings", True)
        given = {**given, "torch_dtype": dtype, "tie_word_embeddings": tied}
    text = {**GEMMA4_TEXT_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    activation = text.get("hidden_activation") or text.get("hidden_act")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(
            f"config.json: Gemma 4 hidden_activation {activation!r} is not supported "
            "(gelu_pytorch_tanh is)"
        )
    # "vision" makes image tokens attend both ways; a text-only prompt is causal anyway.
    if text.get("use_bidirectional_attention") not in (None, "vision"):
        raise ValueError(
            "config.json: Gemma 4 use_bidirectional_attention "
            f"{text['use_bidirectional_attention']!r} is not supported (causal attention is)"
        )
    if text["attention_bias"]:
        raise ValueError("config.json: Gemma 4 with attention_bias is not supported")
    if text.get("attn_logit_softcapping") is not None:
        raise ValueError("config.json: attention logit soft-capping is not supported")
    return text


def _rope_parameters(text: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each layer kind's RoPE (transformers nests them by kind)."""
    nested = text.get("rope_parameters") or DEFAULT_ROPE
    if not isinstance(nested, dict) or not set(nested) <= {*LAYER_TYPES}:
        raise ValueError(
            "config.json: Gemma 4 rope_parameters must give each layer kind's RoPE "
            f"({', '.join(LAYER_TYPES)}), got {nested!r}"
        )
    rope = {}
    for kind in LAYER_TYPES:
        params = dict(nested.get(kind) or DEFAULT_ROPE[kind])
        if kind == SLIDING and params.get("rope_type", "default") == "proportional":
            raise ValueError("config.json: proportional RoPE on sliding layers is not supported")
        rope[kind] = params
    return rope


def _full_layer_heads(text: dict[str, Any], kinds: list[str]) -> tuple[int, int | None]:
    """The full-attention layers' head size and KV heads (None: the model's)."""
    overrides = text.get("per_layer_config")
    if overrides is None:
        kv_heads = text.get("num_global_key_value_heads") if text["attention_k_eq_v"] else None
        return positive_int(text, "global_head_dim"), kv_heads
    if not isinstance(overrides, dict):
        raise ValueError(f"config.json: per_layer_config must be a dict, got {overrides!r}")
    seen = set()
    for layer, kind in enumerate(kinds):
        override = overrides.get(str(layer), overrides.get(layer)) or {}
        if not set(override) <= {"head_dim", "num_key_value_heads"}:
            raise ValueError(
                f"config.json: per_layer_config overrides {sorted(override)} of layer {layer}; "
                "only head_dim and num_key_value_heads are supported"
            )
        if kind == FULL:
            seen.add((override.get("head_dim"), override.get("num_key_value_heads")))
        elif override:
            raise ValueError(
                f"config.json: per_layer_config overrides sliding layer {layer}, which is "
                "not supported (only full-attention layers may differ)"
            )
    if len(seen) > 1:
        raise ValueError(
            f"config.json: per_layer_config gives the full-attention layers different heads "
            f"{sorted(seen, key=str)}; one shape for all of them is supported"
        )
    head_dim, kv_heads = seen.pop() if seen else (None, None)
    return head_dim or positive_int(text, "head_dim"), kv_heads


def _kv_shared_layers(text: dict[str, Any], kinds: list[str]) -> int:
    """How many last layers read another layer's KV; every kind among them must have a
    writing layer before them."""
    shared = text["num_kv_shared_layers"]
    layers = len(kinds)
    if not isinstance(shared, int) or not 0 <= shared < layers:
        raise ValueError(
            f"config.json: num_kv_shared_layers must be 0 to {layers - 1} (some layer must "
            f"write KV), got {shared!r}"
        )
    writers = set(kinds[: layers - shared])
    if shared and writers != set(kinds):
        raise ValueError(
            f"config.json: num_kv_shared_layers {shared} leaves no writing layer of kind "
            f"{sorted(set(kinds) - writers)} for the shared layers to read"
        )
    return shared


def _experts(text: dict[str, Any]) -> MoEConfig:
    """The MoE block beside each layer's MLP: a softmax over the experts, the top k
    renormalised (its own norm and per-expert scale are the model's: ``models/gemma4.py``)."""
    return MoEConfig(
        hidden_size=positive_int(text, "hidden_size"),
        moe_intermediate_size=positive_int(text, "moe_intermediate_size"),
        num_experts=positive_int(text, "num_experts"),
        num_experts_per_tok=positive_int(text, "top_k_experts"),
        n_group=1,
        topk_group=1,
        n_shared_experts=0,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        scoring="softmax",
        activation="gelu_pytorch_tanh",
    )
