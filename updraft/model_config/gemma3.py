"""Gemma 3's config: its text model, and the text tower of the multimodal one."""

from __future__ import annotations

from typing import Any

from updraft.model_config.fields import (
    LAYER_TYPES,
    decoder_fields,
    layer_windows,
    positive_int,
    rope_config,
)

MULTIMODAL = "Gemma3ForConditionalGeneration"
# What a published Gemma 3 text_config leaves out takes transformers' defaults.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
}


def parse(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """``ModelConfig`` fields of a Gemma 3 config.json."""
    text, family = _text_config(raw, architecture)
    fields = decoder_fields(text)
    fields["qk_norm"] = True

    def every_pattern_th_full(layers: int) -> list[bool]:
        pattern = positive_int(text, "sliding_window_pattern")
        return [bool((layer + 1) % pattern) for layer in range(layers)]

    fields["layer_windows"] = layer_windows(text, every_pattern_th_full)
    return {**fields, **family}


def _text_config(raw: dict[str, Any], architecture: str) -> tuple[dict[str, Any], dict]:
    """Gemma 3's text config (with transformers' defaults where a published config is
    silent) and what sets its layers apart from Llama's. Of the multimodal model only
    the text tower is served: its config is ``text_config``."""
    given = raw
    if architecture == MULTIMODAL:
        given = raw.get("text_config")
        if not isinstance(given, dict):
            raise ValueError("config.json: Gemma3ForConditionalGeneration lacks its text_config")
        top = {"torch_dtype": raw.get("torch_dtype") or raw.get("dtype")}
        top["tie_word_embeddings"] = raw.get("tie_word_embeddings", True)
        given = {**top, **given}
    if "sliding_window" in given and given["sliding_window"] is None:
        raise ValueError("config.json: Gemma 3 without a sliding_window is not supported")
    text = {**GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    activation = text.get("hidden_activation") or text.get("hidden_act")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(
            f"config.json: Gemma 3 hidden_activation {activation!r} is not supported "
            "(gelu_pytorch_tanh is)"
        )
    if text.get("attn_logit_softcapping") is not None:
        raise ValueError("config.json: attention logit soft-capping is not supported")
    if text.get("use_bidirectional_attention"):
        raise ValueError("config.json: Gemma 3 bidirectional attention is not supported")
    # transformers 5 nests each layer kind's RoPE in rope_parameters; published configs
    # give the global one as rope_theta (and rope_scaling) and the local base apart.
    nested = text.get("rope_parameters") or {}
    if not set(nested) <= {*LAYER_TYPES}:
        nested = {"full_attention": nested}
    full = {"rope_theta": text["rope_theta"], **(text.get("rope_scaling") or {})}
    full.update(nested.get("full_attention") or {})
    local = {"rope_theta": text["rope_local_base_freq"]}
    local.update(nested.get("sliding_attention") or {})
    text = {**text, "rope_parameters": full, "rope_scaling": None}
    family = {
        "hidden_act": "gelu_pytorch_tanh",
        "norm_offset": 1.0,
        "attention_scale": float(text["query_pre_attn_scalar"]) ** -0.5,
        "local_rope": rope_config({**text, "rope_parameters": local}),
        "embedding_multiplier": float(text["hidden_size"]) ** 0.5,
        # transformers caps the text model's logits but not the multimodal model's
        # (published Gemma 3 configs set no cap either way).
        "final_logit_softcapping": None
        if architecture == MULTIMODAL
        else text.get("final_logit_softcapping"),
    }
    return text, family
