"""The Llama family's configs: Llama, Mistral, Qwen2, Qwen3 and Phi-3 (one decoder with
per-architecture flags), Qwen3-MoE, Mixtral and Qwen2-MoE (the same attention with a
softmax top-k mixture of experts in place of the MLP; Qwen2-MoE's with a gated shared
expert), from config.json or from a GGUF file's metadata."""

from __future__ import annotations

import math
from typing import Any

from updraft.model_config.fields import (
    decoder_fields,
    gguf_decoder_fields,
    layer_windows,
    positive_int,
    require_silu,
)
from updraft.model_config.gguf_experts import ExpertShape, read_experts
from updraft.model_config.parts import MoEConfig

SPARSE_MOE = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM")
QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Where a config's sliding_window applies to every layer; Qwen's windows apply only with
# use_sliding_window (Qwen2's and Qwen3's from layer max_window_layers on, Qwen3-MoE's
# to every layer).
EVERY_LAYER_WINDOWED = (
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen3MoeForCausalLM",
)
QWEN_WINDOWED = (
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
)
FROM_MAX_WINDOW_LAYERS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")


def parse(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """``ModelConfig`` fields of a Llama-family config.json."""
    require_silu(raw)
    fields = decoder_fields(raw)
    # Qwen2 always has q/k/v biases, Qwen2-MoE unless qkv_bias says not; Llama has them
    # only when asked.
    fields["attention_bias"] = (
        architecture == "Qwen2ForCausalLM"
        or (architecture == "Qwen2MoeForCausalLM" and raw.get("qkv_bias", True))
        or fields["attention_bias"]
    )
    fields["qk_norm"] = architecture in QK_NORM
    fields["layer_windows"] = _layer_windows(raw, architecture)
    if architecture in SPARSE_MOE:
        fields.update(_sparse_moe_parts(raw, architecture))
    return fields


def _layer_windows(raw: dict[str, Any], architecture: str) -> tuple[int | None, ...]:
    """As transformers applies the config: every layer's for Mistral, Mixtral, Phi-3 and
    (with use_sliding_window) Qwen3-MoE, whatever else is listed; for Qwen2 and Qwen3,
    with use_sliding_window, layer_types where the config lists them (transformers 5
    writes them), else from max_window_layers on."""
    if architecture in QWEN_WINDOWED and not raw.get("use_sliding_window"):
        return ()
    if architecture in EVERY_LAYER_WINDOWED:
        return layer_windows(raw, lambda layers: [True] * layers, read_layer_types=False)
    if architecture in FROM_MAX_WINDOW_LAYERS:
        first = raw.get("max_window_layers", 28)  # transformers' default
        return layer_windows(raw, lambda layers: [layer >= first for layer in range(layers)])
    if architecture == "Qwen2MoeForCausalLM":  # even-numbered layers below max_window_layers
        last = raw.get("max_window_layers", 28)
        return layer_windows(raw, lambda layers: [i % 2 == 0 and i < last for i in range(layers)])
    return ()


def _sparse_moe_parts(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Qwen3-MoE, Mixtral and Qwen2-MoE: softmax over every expert, the top k kept
    (renormalised where norm_topk_prob says so; Mixtral always); Qwen2-MoE's one shared
    expert, gated."""
    layers = positive_int(raw, "num_hidden_layers")
    # Published Qwen3-MoE configs say num_experts; transformers 5 writes num_local_experts.
    key = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
    num_experts = positive_int(raw, key)
    if architecture == "MixtralForCausalLM":
        inter, norm, dense = positive_int(raw, "intermediate_size"), True, frozenset()
    else:
        inter = positive_int(raw, "moe_intermediate_size")
        norm = bool(raw.get("norm_topk_prob", False))
        step = raw.get("decoder_sparse_step") or 1
        only_mlp = set(raw.get("mlp_only_layers") or ())
        dense = frozenset(i for i in range(layers) if i in only_mlp or (i + 1) % step)
    moe = MoEConfig(
        hidden_size=positive_int(raw, "hidden_size"),
        moe_intermediate_size=inter,
        num_experts=num_experts,
        num_experts_per_tok=positive_int(raw, "num_experts_per_tok"),
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=norm,
        scoring="softmax",
        group_score="max",
        **_shared_expert(raw, architecture),
    )
    if moe.num_experts_per_tok > num_experts:
        raise ValueError(
            f"config.json: num_experts_per_tok {moe.num_experts_per_tok} is more than the "
            f"{num_experts} experts"
        )
    return {"moe": moe, "dense_layers": dense}


def _shared_expert(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Qwen2-MoE's shared expert: shared_expert_intermediate_size rows, gated."""
    if architecture != "Qwen2MoeForCausalLM":
        return {"n_shared_experts": 0}
    size = positive_int(raw, "shared_expert_intermediate_size")
    return {"n_shared_experts": 1, "shared_intermediate_size": size, "shared_expert_gate": True}


def from_gguf(
    file_name: str,
    architecture: str,
    get: Any,
    tensors: dict[str, tuple[str, tuple[int, ...]]],
) -> dict[str, Any]:
    """The config.json that transformers would write for a Llama-family GGUF file:
    ``get(key, default)`` reads the file's ``<arch>.<key>`` metadata. A file's
    ``rope_freqs`` (how llama.cpp holds Llama 3.1's scaling) becomes RoPE's
    ``frequency_factors``."""
    config = gguf_decoder_fields(architecture, get, tensors)
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    config["head_dim"] = int(get("attention.key_length", hidden // heads))
    config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling not in ("linear", "yarn"):
            raise ValueError(f"{file_name}: GGUF RoPE scaling {scaling!r} is not supported")
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": float(get("rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(
                get("rope.scaling.original_context_length", config["max_position_embeddings"])
            ),
        }
    if "rope_freqs.weight" in tensors:
        factors = frequency_factors(file_name, tensors, "rope_freqs.weight", config["head_dim"])
        config.setdefault("rope_scaling", {"rope_type": "default"})["frequency_factors"] = factors
    experts = read_experts(file_name, get, tensors, config["num_hidden_layers"])
    if experts is not None:
        config.update(_gguf_expert_fields(file_name, architecture, experts))
    return config


def frequency_factors(file_name: str, tensors: Any, name: str, rotary_dim: int) -> list[float]:
    """The values of the GGUF tensor ``name``: one RoPE factor per frequency."""
    values = list(tensors.values_of(name))
    if len(values) != rotary_dim // 2:
        raise ValueError(
            f"{file_name}: {name} holds {len(values)} values; its {rotary_dim} rotary "
            f"dimensions need {rotary_dim // 2}, one per frequency"
        )
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"{file_name}: {name} holds a factor that is not a positive number")
    return values


# llama.cpp's names of Phi-3's fused projections (tried before the shared names).
PHI3_GGUF_TENSORS = (
    (r"blk\.(\d+)\.attn_qkv\.weight", r"model.layers.\1.self_attn.qkv_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.gate_up_proj.weight"),
)


def phi3_from_gguf(
    file_name: str,
    architecture: str,
    get: Any,
    tensors: dict[str, tuple[str, tuple[int, ...]]],
) -> dict[str, Any]:
    """The config.json of a Phi-3 (or Phi-4-mini) GGUF file: partial rotary from
    ``rope.dimension_count``, LongRoPE from its ``rope_factors_long``/``_short`` tensors
    and the attention factor the file names, a window from ``attention.sliding_window``
    (0: none), applied to every layer as transformers does (llama.cpp leaves Phi's
    windows off)."""
    config = gguf_decoder_fields(architecture, get, tensors, eps=1e-5, context=4096)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotary_dim = int(get("rope.dimension_count", head_dim))
    context = config["max_position_embeddings"]
    config["partial_rotary_factor"] = rotary_dim / head_dim
    config["sliding_window"] = int(get("attention.sliding_window", 0)) or None
    long, short = "rope_factors_long.weight", "rope_factors_short.weight"
    if (long in tensors) != (short in tensors):
        raise ValueError(f"{file_name}: LongRoPE needs both {long} and {short}")
    if long in tensors:
        original = int(get("rope.scaling.original_context_length", context))
        config["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": frequency_factors(file_name, tensors, long, rotary_dim),
            "short_factor": frequency_factors(file_name, tensors, short, rotary_dim),
            "original_max_position_embeddings": original,
            "factor": context / original,
        }
        if get("rope.scaling.attn_factor") is not None:
            config["rope_scaling"]["attention_factor"] = float(get("rope.scaling.attn_factor"))
    return config


def _gguf_expert_fields(file_name: str, architecture: str, experts: ExpertShape) -> dict[str, Any]:
    """config.json's expert fields, as each family names them. The file is routed as
    llama.cpp's code routes its architecture, whatever the checkpoint said: Qwen3-MoE's
    and Mixtral's (a llama file with experts) top-k weights renormalised, Qwen2-MoE's
    not (the converter writes no norm_topk_prob); a layer without a router is dense."""
    if architecture == "LlamaForCausalLM":
        if experts.dense_layers or experts.shared_width:
            raise ValueError(
                f"{file_name}: a llama file with experts is read as Mixtral, whose every "
                "layer has routed experts only"
            )
        return {
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": experts.num_experts,
            "num_experts_per_tok": experts.experts_per_token,
            "intermediate_size": experts.width,
        }
    fields = {
        "num_experts": experts.num_experts,
        "num_experts_per_tok": experts.experts_per_token,
        "moe_intermediate_size": experts.width,
        "norm_topk_prob": architecture == "Qwen3MoeForCausalLM",
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(experts.dense_layers),
    }
    if architecture == "Qwen2MoeForCausalLM":
        if not experts.shared_width:
            raise ValueError(f"{file_name}: a qwen2moe file without its shared expert")
        fields["shared_expert_intermediate_size"] = experts.shared_width
    return fields
