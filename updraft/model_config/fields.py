"""Readers of the config.json fields that every family shares: checked integers, the
dtype, RoPE, EOS ids, per-layer sliding windows and a decoder's common sizes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from updraft.model_config.parts import RopeConfig
from updraft.weights import DTYPES

LAYER_TYPES = ("sliding_attention", "full_attention")
ROPE_KINDS = ("default", "linear", "llama3", "yarn", "longrope", "proportional")


def positive_int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if value is None:
        raise ValueError(f"config.json lacks {key!r}, which the model needs")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json: {key} must be a positive int, got {value!r}")
    return value


def optional_positive_int(raw: dict[str, Any], key: str) -> int | None:
    """``key``'s positive int, or None where the config leaves it out (or null)."""
    return None if raw.get(key) is None else positive_int(raw, key)


def positive_number(raw: dict[str, Any], key: str, default: float) -> float:
    value = default if raw.get(key) is None else raw[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e300:
        raise ValueError(f"config.json: {key} must be a positive number, got {value!r}")
    return value


def dtype_name(value: Any) -> str:
    name = str(value or "float32").removeprefix("torch.")
    return name if name in DTYPES else "float32"


def require_silu(raw: dict[str, Any]) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"config.json: hidden_act {raw['hidden_act']!r} is not supported (silu is)"
        )


def decoder_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The ``ModelConfig`` fields every decoder has, as config.json gives them."""
    num_heads = positive_int(raw, "num_attention_heads")
    hidden_size = positive_int(raw, "hidden_size")
    return {
        "vocab_size": positive_int(raw, "vocab_size"),
        "hidden_size": hidden_size,
        "intermediate_size": positive_int(raw, "intermediate_size"),
        "num_layers": positive_int(raw, "num_hidden_layers"),
        "num_heads": num_heads,
        "num_kv_heads": optional_positive_int(raw, "num_key_value_heads") or num_heads,
        "head_dim": optional_positive_int(raw, "head_dim") or hidden_size // num_heads,
        "rms_norm_eps": positive_number(raw, "rms_norm_eps", 1e-6),
        "max_position_embeddings": optional_positive_int(raw, "max_position_embeddings") or 2048,
        "rope": rope_config(raw),
        "tie_word_embeddings": raw.get("tie_word_embeddings", False),
        "attention_bias": raw.get("attention_bias", False),
        "mlp_bias": raw.get("mlp_bias", False),
        "qk_norm": False,
        "checkpoint_dtype": dtype_name(raw.get("torch_dtype") or raw.get("dtype")),
        "partial_rotary_factor": float(
            (raw.get("rope_parameters") or {}).get("partial_rotary_factor")
            or raw.get("partial_rotary_factor")
            or 1.0
        ),
    }


def layer_windows(
    raw: dict[str, Any],
    sliding: Callable[[int], list[bool]],
    read_layer_types: bool = True,
) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), or () when the config sets
    none. Which layers slide: ``layer_types`` where the config lists them (and the
    family reads them), else ``sliding(num_layers)``, the family's own rule."""
    if raw.get("sliding_window") is None:
        return ()
    window = positive_int(raw, "sliding_window")
    layers = positive_int(raw, "num_hidden_layers")
    kinds = raw.get("layer_types") if read_layer_types else None
    if kinds is None:
        slides = sliding(layers)
    else:
        if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {*LAYER_TYPES}:
            raise ValueError(
                f"config.json: layer_types must list one of {', '.join(LAYER_TYPES)} for each "
                f"of the {layers} layers, got {kinds!r}"
            )
        slides = [kind == "sliding_attention" for kind in kinds]
    return tuple(window if slide else None for slide in slides)


def rope_config(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes ``rope_parameters`` (theta inside); older checkpoints write
    # ``rope_theta`` beside an optional ``rope_scaling``.
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise ValueError(f"unsupported RoPE type {kind!r}; supported: {', '.join(ROPE_KINDS)}")
    original = int(
        params.get("original_max_position_embeddings")
        or raw.get("original_max_position_embeddings")
        or 8192
    )
    factor = params.get("factor")
    if factor is None and kind in ("yarn", "longrope"):
        # Without a factor they stretch the original context to the new one.
        factor = raw.get("max_position_embeddings", original) / original
    factor = 1 if factor is None else factor
    factors = {}
    if kind == "longrope":
        factors = {
            name: tuple(float(f) for f in params.get(name) or ())
            for name in ("short_factor", "long_factor")
        }
    optional = {
        name: float(params[name]) if params.get(name) is not None else None
        for name in ("mscale", "mscale_all_dim", "attention_factor")
    }
    frequency_factors = params.get("frequency_factors")
    if frequency_factors is not None:
        if kind in ("llama3", "longrope"):
            raise ValueError(f"RoPE frequency_factors cannot be combined with {kind} scaling")
        frequency_factors = tuple(float(f) for f in frequency_factors)
    if kind == "proportional":
        optional["proportion"] = float(params.get("partial_rotary_factor", 1.0))
    return RopeConfig(
        theta=float(theta),
        kind=kind,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        frequency_factors=frequency_factors,
        **optional,
        **factors,
    )


def read_eos_token_ids(model_dir: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present (it is what generate uses), else
    from config.json."""
    value = raw.get("eos_token_id")
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        value = json.loads(generation_config.read_text()).get("eos_token_id", value)
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def gguf_decoder_fields(
    architecture: str,
    get: Any,
    tensors: dict[str, tuple[str, tuple[int, ...]]],
    *,
    eps: float = 1e-6,
    context: int = 2048,
    rope_base: float = 10000.0,
) -> dict[str, Any]:
    """The config.json sizes every decoder's GGUF file gives alike: ``get(key,
    default)`` reads its ``<arch>.<key>`` metadata; the defaults are llama.cpp's for the
    family, where a file leaves a key out."""
    heads = int(get("attention.head_count"))
    return {
        "architectures": [architecture],
        "vocab_size": tensors["token_embd.weight"][1][0],
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", eps)),
        "max_position_embeddings": int(get("context_length", context)),
        "rope_theta": float(get("rope.freq_base", rope_base)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
