"""Gemma 3's config: its text model, and the text tower of the multimodal one."""

from __future__ import annotations

from typing import Any

from updraft.model_config.fields import (
    LAYER_TYPES,
    decoder_fields,
    gguf_decoder_fields,
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


# llama.cpp's names of Gemma's norms where they differ from a Llama file's (tried before
# the shared names); its converter stores every norm's weight as 1 + the checkpoint's.
GGUF_TENSORS = (
    (
        r"blk\.(\d+)\.post_attention_norm\.weight",
        r"model.layers.\1.post_attention_layernorm.weight",
    ),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.pre_feedforward_layernorm.weight"),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", r"model.layers.\1.post_feedforward_layernorm.weight"),
)
GGUF_NORM_SHIFT = 1.0
# What llama.cpp fixes for Gemma 3 rather than reads: every sixth layer global, the
# sliding layers' RoPE base, and (for its 62-layer 27B) queries scaled by
# hidden_size / heads rather than the head size.
GGUF_WINDOW_PATTERN = 6
GGUF_LOCAL_BASE = 10_000.0
GGUF_HIDDEN_SCALED_LAYERS = 62


def from_gguf(
    file_name: str,
    architecture: str,
    get: Any,
    tensors: dict[str, tuple[str, tuple[int, ...]]],
) -> dict[str, Any]:
    """The config.json of a Gemma 3 GGUF file (the text model), read as llama.cpp reads
    it: the window's pattern from ``attention.sliding_window_pattern`` where the file
    has one, else llama.cpp's fixed one; the local RoPE base likewise."""
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    layers = int(get("block_count"))
    head_dim = int(get("attention.key_length", 256))
    window = get("attention.sliding_window")
    if not window:
        raise ValueError(f"{file_name}: a Gemma 3 file needs gemma3.attention.sliding_window")
    config = gguf_decoder_fields(architecture, get, tensors, context=131_072, rope_base=1_000_000.0)
    config |= {
        "head_dim": head_dim,
        "rope_local_base_freq": float(get("rope.freq_base_swa", GGUF_LOCAL_BASE)),
        "query_pre_attn_scalar": hidden // heads
        if layers == GGUF_HIDDEN_SCALED_LAYERS
        else head_dim,
        "sliding_window": int(window),
        "layer_types": _gguf_layer_types(
            file_name, get("attention.sliding_window_pattern"), layers
        ),
        "final_logit_softcapping": get("final_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
    }
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"{file_name}: Gemma 3 RoPE scaling {scaling!r} is not supported")
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(get("rope.scaling.factor", 1.0)),
        }
    return config


def _gguf_layer_types(file_name: str, pattern: Any, layers: int) -> list[str]:
    """Which layers slide: a list of flags as the file gives it, or a period ``n`` (as
    llama.cpp counts it: in each ``n`` layers all but the last slide; 0: all slide)."""
    if pattern is None:
        pattern = GGUF_WINDOW_PATTERN
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(
                f"{file_name}: attention.sliding_window_pattern lists {len(pattern)} layers, "
                f"the file has {layers}"
            )
        slides = [bool(flag) for flag in pattern]
    else:
        period = int(pattern)
        slides = [period == 0 or layer % period < period - 1 for layer in range(layers)]
    return [LAYER_TYPES[0] if slide else LAYER_TYPES[1] for slide in slides]
