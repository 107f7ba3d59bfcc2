"""The config.json of a Gemma 4 GGUF file (llama.cpp's ``gemma4``: the text model), as
transformers would write it for the checkpoint the file came from, checked against the
file's tensors before anything loads.

llama.cpp's converter writes a sliding and a full layer's sizes apart: the head size of
the full layers as ``attention.key_length`` and of the sliding ones as
``key_length_swa``, their key/value heads as one ``attention.head_count_kv`` per layer,
which layers slide as ``attention.sliding_window_pattern`` (one flag per layer), the
last ``attention.shared_kv_layers`` layers as reading earlier layers' keys and values,
the per-layer inputs' width as ``embedding_length_per_layer_input`` (0: none), and a
double-wide MLP as one ``feed_forward_length`` per layer (twice as wide in the shared
layers). The full layers' proportional RoPE reaches the file as ``rope_freqs``: a
divisor of 1 for each turned frequency, 1e30 (no turn) for the rest. A full layer
without ``attn_v`` takes its values from its keys (``attention_k_eq_v``). The converter
changes no values: Gemma 4's norms are stored as the checkpoint's weights.
"""

from __future__ import annotations

import struct
from typing import Any

from updraft.model_config.fields import LAYER_TYPES
from updraft.model_config.gguf_experts import read_experts

Tensors = dict[str, tuple[str, tuple[int, ...]]]  # name -> (type, shape, rows first)

# llama.cpp's names of Gemma 4's tensors where they differ from a Llama file's (tried
# before the shared names), as transformers' Gemma 4 checkpoints name them.
GGUF_TENSORS = (
    (r"per_layer_token_embd\.weight", "model.embed_tokens_per_layer.weight"),
    (r"per_layer_model_proj\.weight", "model.per_layer_model_projection.weight"),
    (r"per_layer_proj_norm\.weight", "model.per_layer_projection_norm.weight"),
    (
        r"blk\.(\d+)\.post_attention_norm\.weight",
        r"model.layers.\1.post_attention_layernorm.weight",
    ),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.pre_feedforward_layernorm.weight"),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", r"model.layers.\1.post_feedforward_layernorm.weight"),
    (
        r"blk\.(\d+)\.post_ffw_norm_(1|2)\.weight",
        r"model.layers.\1.post_feedforward_layernorm_\2.weight",
    ),
    (r"blk\.(\d+)\.pre_ffw_norm_2\.weight", r"model.layers.\1.pre_feedforward_layernorm_2.weight"),
    (r"blk\.(\d+)\.layer_output_scale\.weight", r"model.layers.\1.layer_scalar"),
    (r"blk\.(\d+)\.inp_gate\.weight", r"model.layers.\1.per_layer_input_gate.weight"),
    (r"blk\.(\d+)\.proj\.weight", r"model.layers.\1.per_layer_projection.weight"),
    (r"blk\.(\d+)\.post_norm\.weight", r"model.layers.\1.post_per_layer_input_norm.weight"),
    # the router of a layer's experts: its projection, its input's scale and each
    # expert's output scale (which the converter files as the down projections')
    (r"blk\.(\d+)\.ffn_gate_inp\.weight", r"model.layers.\1.router.proj.weight"),
    (r"blk\.(\d+)\.ffn_gate_inp\.scale", r"model.layers.\1.router.scale"),
    (r"blk\.(\d+)\.ffn_down_exps\.scale", r"model.layers.\1.router.per_expert_scale"),
)
# The value llama.cpp's converter gives an unturned frequency's divisor.
UNTURNED = 1e30


def from_gguf(file_name: str, architecture: str, get: Any, tensors: Tensors) -> dict[str, Any]:
    """The config.json of a Gemma 4 file: ``get(key, default)`` reads its ``gemma4.``
    metadata. A missing or inconsistent size, or a layer without one of its tensors, is
    refused naming it."""
    need = needing(file_name, get)
    hidden, layers, heads = (
        need("embedding_length"),
        need("block_count"),
        need("attention.head_count"),
    )
    head_dim, global_head_dim = need("attention.key_length_swa"), need("attention.key_length")
    layer_types = _layer_types(file_name, get("attention.sliding_window_pattern"), layers)
    shared = int(get("attention.shared_kv_layers", 0) or 0)
    if not 0 <= shared < layers:
        raise ValueError(f"{file_name}: attention.shared_kv_layers {shared} of {layers} layers")
    kv_heads, global_kv_heads = _kv_heads(file_name, get, layer_types, heads)
    width, double_wide = _mlp_width(file_name, get, layers, shared)
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{file_name}: the file has no token_embd.weight")
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": "gemma4_text",
        "vocab_size": tensors["token_embd.weight"][1][0],
        "hidden_size": hidden,
        "intermediate_size": width,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "global_head_dim": global_head_dim,
        "rms_norm_eps": float32_decimal(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 131_072)),
        "sliding_window": need("attention.sliding_window"),
        "layer_types": layer_types,
        "final_logit_softcapping": get("final_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": "output.weight" not in tensors,
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": double_wide,
        "attention_k_eq_v": _keys_are_values(file_name, tensors, layer_types, shared),
        "rope_parameters": _rope(file_name, get, tensors, head_dim, global_head_dim),
        "torch_dtype": "float32",
    }
    if global_kv_heads != kv_heads:
        if not config["attention_k_eq_v"]:
            raise ValueError(
                f"{file_name}: full layers with {global_kv_heads} key/value heads and sliding "
                f"ones with {kv_heads} are read only where full layers take values from keys"
            )
        config["num_global_key_value_heads"] = global_kv_heads
    config.update(_per_layer_inputs(file_name, get, tensors, layers))
    config.update(_experts(file_name, get, tensors, layers))
    _check_tensors(file_name, tensors, config)
    return config


def float32_decimal(value: float) -> float:
    """The shortest decimal that a float32 metadata value rounds from (1e-06, not
    9.99999997e-07): the value the checkpoint's config wrote."""
    stored = struct.pack("<f", value)
    for digits in range(1, 10):
        decimal = float(f"{value:.{digits}g}")
        if struct.pack("<f", decimal) == stored:
            return decimal
    return float(value)


def needing(file_name: str, get: Any) -> Any:
    """``need(key)``: the positive number ``key`` of the file's metadata (read by
    ``get``), or an error naming the key."""

    def need(key: str) -> int:
        value = get(key)
        if value is None:
            raise ValueError(f"{file_name}: the GGUF metadata lacks {key}, which the model needs")
        if isinstance(value, list) or int(value) < 1:
            raise ValueError(f"{file_name}: {key} must be a positive number, got {value}")
        return int(value)

    return need


def _layer_types(file_name: str, pattern: Any, layers: int) -> list[str]:
    """Which layers slide: the file's one flag per layer (the converter always writes
    them)."""
    if not isinstance(pattern, list) or len(pattern) != layers:
        got = "none" if pattern is None else f"{pattern!r}"
        raise ValueError(
            f"{file_name}: attention.sliding_window_pattern must flag each of the "
            f"{layers} layers, got {got}"
        )
    kinds = [LAYER_TYPES[0] if flag else LAYER_TYPES[1] for flag in pattern]
    if kinds[-1] != LAYER_TYPES[1]:
        raise ValueError(f"{file_name}: Gemma 4's last layer {layers - 1} must be full attention")
    return kinds


def _kv_heads(file_name: str, get: Any, layer_types: list[str], heads: int) -> tuple[int, int]:
    """The sliding layers' key/value heads and the full layers': one count per layer
    (the same within each kind) or one for all."""
    counts = get("attention.head_count_kv", heads)
    if not isinstance(counts, list):
        counts = [counts] * len(layer_types)
    if len(counts) != len(layer_types):
        raise ValueError(
            f"{file_name}: attention.head_count_kv lists {len(counts)} layers, the "
            f"file has {len(layer_types)}"
        )
    by_kind: dict[str, set[int]] = {}
    for kind, count in zip(layer_types, counts, strict=True):
        by_kind.setdefault(kind, set()).add(int(count))
    for kind, found in by_kind.items():
        if len(found) != 1 or min(found) < 1 or heads % min(found):
            raise ValueError(
                f"{file_name}: attention.head_count_kv gives the {kind} layers "
                f"{sorted(found)} key/value heads; one count dividing the {heads} heads is read"
            )
    sliding = by_kind.get(LAYER_TYPES[0], by_kind[LAYER_TYPES[1]])
    return min(sliding), min(by_kind[LAYER_TYPES[1]])


def _mlp_width(file_name: str, get: Any, layers: int, shared: int) -> tuple[int, bool]:
    """The MLP's width, and whether the KV-shared layers' MLPs are twice as wide (the
    converter lists one width per layer only then)."""
    widths = get("feed_forward_length")
    if widths is None:
        raise ValueError(f"{file_name}: the GGUF metadata lacks feed_forward_length")
    if not isinstance(widths, list):
        return int(widths), False
    base = int(widths[0])
    first_shared = layers - shared
    double = [base if layer < first_shared else 2 * base for layer in range(layers)]
    if [int(width) for width in widths] != double:
        raise ValueError(
            f"{file_name}: feed_forward_length lists {widths}; per-layer widths are "
            f"read only as {base} then twice that in the {shared} KV-shared layers"
        )
    return base, True


def _keys_are_values(file_name: str, tensors: Tensors, layer_types: list[str], shared: int) -> bool:
    """Whether the full layers take their values from their keys: those that write
    keys and values hold no ``attn_v`` then (all alike), the sliding layers always do."""
    writing = range(len(layer_types) - shared)
    without = {
        layer_types[layer] for layer in writing if f"blk.{layer}.attn_v.weight" not in tensors
    }
    full = [layer for layer in writing if layer_types[layer] == LAYER_TYPES[1]]
    if LAYER_TYPES[0] in without:
        layer = next(
            layer
            for layer in writing
            if layer_types[layer] == LAYER_TYPES[0] and f"blk.{layer}.attn_v.weight" not in tensors
        )
        raise ValueError(f"{file_name}: sliding layer {layer} lacks blk.{layer}.attn_v.weight")
    if not without:
        return False
    having = [layer for layer in full if f"blk.{layer}.attn_v.weight" in tensors]
    if having:
        raise ValueError(
            f"{file_name}: full layers {having} hold attn_v and others none; either all "
            "take their values from their keys or none does"
        )
    return True


def _rope(
    file_name: str, get: Any, tensors: Tensors, head_dim: int, global_head_dim: int
) -> dict[str, dict[str, Any]]:
    """Each layer kind's RoPE: the sliding layers' turning their first
    ``rope.dimension_count_swa`` dimensions, the full layers' proportional share read
    from ``rope_freqs``."""
    sliding_rot = int(get("rope.dimension_count_swa", head_dim))
    if not 0 < sliding_rot <= head_dim or sliding_rot % 2:
        raise ValueError(
            f"{file_name}: rope.dimension_count_swa {sliding_rot} does not fit the "
            f"sliding layers' heads of {head_dim}"
        )
    sliding = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10_000.0))}
    if sliding_rot != head_dim:
        sliding["partial_rotary_factor"] = sliding_rot / head_dim
    full_rot = int(get("rope.dimension_count", global_head_dim))
    if "rope_freqs.weight" in tensors:
        full_rot = 2 * _turned(file_name, tensors.values_of("rope_freqs.weight"), global_head_dim)
    if not 0 < full_rot <= global_head_dim:
        raise ValueError(
            f"{file_name}: the full layers turn {full_rot} of their {global_head_dim} dimensions"
        )
    full = {
        "rope_type": "proportional",
        "partial_rotary_factor": full_rot / global_head_dim,
        "rope_theta": float(get("rope.freq_base", 1_000_000.0)),
    }
    return {LAYER_TYPES[0]: sliding, LAYER_TYPES[1]: full}


def _turned(file_name: str, divisors: tuple[float, ...], global_head_dim: int) -> int:
    """How many frequencies ``rope_freqs`` turns: 1 for each of the first few, 1e30 after."""
    turned = sum(1 for value in divisors if value == 1.0)
    expected = [1.0] * turned + [UNTURNED] * (global_head_dim // 2 - turned)
    if (
        len(divisors) != global_head_dim // 2
        or [
            1.0 if value == 1.0 else UNTURNED if value >= UNTURNED / 2 else value
            for value in divisors
        ]
        != expected
    ):
        raise ValueError(
            f"{file_name}: rope_freqs holds {len(divisors)} divisors; the full layers' "
            f"proportional RoPE gives {global_head_dim // 2}, 1 for each turned frequency and "
            "1e30 after"
        )
    return turned


def _per_layer_inputs(file_name: str, get: Any, tensors: Tensors, layers: int) -> dict[str, int]:
    """The per-layer inputs' width and their embedding's vocabulary (a table of
    ``layers * width`` columns)."""
    width = int(get("embedding_length_per_layer_input", 0) or 0)
    table = tensors.get("per_layer_token_embd.weight")
    if not width:
        if table is not None:
            raise ValueError(
                f"{file_name}: per_layer_token_embd.weight in a file whose "
                "embedding_length_per_layer_input is 0"
            )
        return {"hidden_size_per_layer_input": 0}
    if table is None:
        raise ValueError(
            f"{file_name}: embedding_length_per_layer_input is {width} but the file "
            "has no per_layer_token_embd.weight"
        )
    if len(table[1]) != 2 or table[1][1] != layers * width:
        raise ValueError(
            f"{file_name}: per_layer_token_embd.weight has shape {list(table[1])} (rows "
            f"first), not [vocabulary, {layers * width}] for {layers} layers of {width}"
        )
    return {"hidden_size_per_layer_input": width, "vocab_size_per_layer_input": table[1][0]}


def _experts(file_name: str, get: Any, tensors: Tensors, layers: int) -> dict[str, Any]:
    """The experts every layer of a Gemma 4 mixture routes to beside its dense MLP."""
    experts = read_experts(file_name, get, tensors, layers)
    if experts is None:
        return {"enable_moe_block": False}
    if experts.dense_layers:
        raise ValueError(
            f"{file_name}: layers {list(experts.dense_layers)} have no router "
            "(ffn_gate_inp); every layer of a Gemma 4 mixture routes to experts"
        )
    return {
        "enable_moe_block": True,
        "num_experts": experts.num_experts,
        "top_k_experts": experts.experts_per_token,
        "moe_intermediate_size": experts.width,
    }


def _check_tensors(file_name: str, tensors: Tensors, config: dict[str, Any]) -> None:
    """Every layer holds the attention tensors its kind gives, in the sizes the
    metadata gives; the KV-shared layers hold no keys or values."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    layers, shared = config["num_hidden_layers"], config["num_kv_shared_layers"]
    for layer, kind in enumerate(config["layer_types"]):
        full = kind == LAYER_TYPES[1]
        head_dim = config["global_head_dim"] if full else config["head_dim"]
        kv = (
            config.get("num_global_key_value_heads", config["num_key_value_heads"])
            if full
            else config["num_key_value_heads"]
        )
        shapes = {
            "attn_q.weight": (heads * head_dim, hidden),
            "attn_output.weight": (hidden, heads * head_dim),
        }
        if layer < layers - shared:
            shapes["attn_k.weight"] = (kv * head_dim, hidden)
            if not (full and config["attention_k_eq_v"]):
                shapes["attn_v.weight"] = (kv * head_dim, hidden)
        else:
            stray = [
                f"blk.{layer}.{name}"
                for name in ("attn_k.weight", "attn_v.weight")
                if f"blk.{layer}.{name}" in tensors
            ]
            if stray:
                raise ValueError(f"{file_name}: KV-shared layer {layer} holds {', '.join(stray)}")
        check_layer_shapes(file_name, tensors, layer, shapes, f"{kind} sizes")


def check_layer_shapes(
    file_name: str,
    tensors: Tensors,
    layer: int,
    shapes: dict[str, tuple[int, ...]],
    sizes: str = "sizes",
) -> None:
    """Layer ``layer`` holds each of ``shapes`` (``blk.{layer}.`` names, rows first) in
    that shape, which the file's ``sizes`` give; else a ValueError naming it."""
    for name, shape in shapes.items():
        found = tensors.get(f"blk.{layer}.{name}")
        if found is None:
            raise ValueError(f"{file_name}: layer {layer} lacks blk.{layer}.{name}")
        if tuple(found[1]) != shape:
            raise ValueError(
                f"{file_name}: blk.{layer}.{name} has shape {list(found[1])} (rows first), "
                f"not {list(shape)} as the file's {sizes} give"
            )
