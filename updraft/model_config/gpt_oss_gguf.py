"""The config.json of a gpt-oss GGUF file (llama.cpp's ``gpt-oss``), as transformers
would write it for the checkpoint the file came from, checked against the file's
tensors before anything loads.

What llama.cpp fixes for gpt-oss rather than reads: every other layer slides (the
first does), the experts' clamped SwiGLU (alpha 1.702, limit 7, unless the file states
``swiglu_clamp_exp``), the top k's weights
a softmax over the k chosen, and attention with biases and one sink per head. Its
converter splits transformers' interleaved gate/up columns into ``ffn_gate_exps`` and
``ffn_up_exps`` (and their biases), transposes the float experts into rows of their
inputs, and writes HF's MXFP4 experts as GGUF MXFP4 blocks; the router keeps its bias,
each layer's sinks are ``attn_sinks``. YaRN's scaling reaches the file as
``rope.scaling.*``; gpt-oss's checkpoints turn it without rounding YaRN's ramp to whole
dimensions (transformers' ``truncate: false``), which the file leaves unsaid.
"""

from __future__ import annotations

from typing import Any

from updraft.model_config.fields import LAYER_TYPES
from updraft.model_config.gemma4_gguf import check_layer_shapes, float32_decimal, needing
from updraft.model_config.gguf_experts import read_experts

Tensors = dict[str, tuple[str, tuple[int, ...]]]  # name -> (type, shape, rows first)

# llama.cpp's names of gpt-oss's tensors where they differ from a Llama file's (tried
# before the shared names), as transformers' gpt-oss checkpoints name them.
GGUF_TENSORS = (
    (
        r"blk\.(\d+)\.post_attention_norm\.weight",
        r"model.layers.\1.post_attention_layernorm.weight",
    ),
    (r"blk\.(\d+)\.attn_output\.bias", r"model.layers.\1.self_attn.o_proj.bias"),
    (r"blk\.(\d+)\.attn_sinks\.weight", r"model.layers.\1.self_attn.sinks"),
    (r"blk\.(\d+)\.ffn_gate_inp\.(weight|bias)", r"model.layers.\1.mlp.router.\2"),
)
# What llama.cpp fixes for every gpt-oss file.
SLIDING_PERIOD = 2  # layers 0, 2, 4, ... slide
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0
# A layer's tensors beside its experts.
LAYER_TENSORS = ("attn_norm.weight", "post_attention_norm.weight", "attn_sinks.weight")
ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")


def from_gguf(file_name: str, architecture: str, get: Any, tensors: Tensors) -> dict[str, Any]:
    """The config.json of a gpt-oss file: ``get(key, default)`` reads its ``gpt-oss.``
    metadata. A missing or inconsistent size, or a layer without one of its tensors,
    is refused naming it."""

    need = needing(file_name, get)
    hidden, layers, heads = (
        need("embedding_length"),
        need("block_count"),
        need("attention.head_count"),
    )
    kv_heads = (
        need("attention.head_count_kv") if get("attention.head_count_kv") is not None else heads
    )
    if heads % kv_heads:
        raise ValueError(f"{file_name}: {heads} heads do not share {kv_heads} key/value heads")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{file_name}: the file has no token_embd.weight")
    experts = read_experts(file_name, get, tensors, layers)
    if experts is None:
        raise ValueError(f"{file_name}: the GGUF metadata lacks expert_count")
    if experts.dense_layers:
        raise ValueError(
            f"{file_name}: layers {list(experts.dense_layers)} have no router (ffn_gate_inp)"
        )
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": "gpt_oss",
        "vocab_size": tensors["token_embd.weight"][1][0],
        "hidden_size": hidden,
        "intermediate_size": experts.width,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "num_local_experts": experts.num_experts,
        "num_experts_per_tok": experts.experts_per_token,
        "rms_norm_eps": float32_decimal(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(get("context_length", 131_072)),
        "sliding_window": need("attention.sliding_window"),
        "layer_types": [
            LAYER_TYPES[0] if layer % SLIDING_PERIOD == 0 else LAYER_TYPES[1]
            for layer in range(layers)
        ],
        "attention_bias": True,
        "hidden_act": "silu",
        "swiglu_alpha": SWIGLU_ALPHA,
        "swiglu_limit": _clamp(file_name, get, layers),
        "tie_word_embeddings": "output.weight" not in tensors,
        "rope_parameters": _rope(file_name, get),
        "torch_dtype": "float32",
    }
    _check_tensors(file_name, tensors, config)
    return config


def _clamp(file_name: str, get: Any, layers: int) -> float:
    """The experts' SwiGLU clamp: llama.cpp's fixed 7, unless the file states one per
    layer (``swiglu_clamp_exp``, as other families' files do), the same in each."""
    limits = get("swiglu_clamp_exp")
    if limits is None:
        return SWIGLU_LIMIT
    limits = limits if isinstance(limits, list) else [limits] * layers
    if len(limits) != layers or len(set(limits)) != 1 or not limits[0] > 0:
        raise ValueError(
            f"{file_name}: swiglu_clamp_exp is {limits}; one positive clamp for "
            f"all {layers} layers is read"
        )
    return float32_decimal(limits[0])


def _rope(file_name: str, get: Any) -> dict[str, Any]:
    """The RoPE the file states: YaRN (as every gpt-oss checkpoint's), or none."""
    theta = float(get("rope.freq_base", 150_000.0))
    scaling = get("rope.scaling.type")
    if scaling in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if scaling != "yarn":
        raise ValueError(
            f"{file_name}: gpt-oss RoPE scaling {scaling!r} is not supported (yarn is)"
        )
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": float(get("rope.scaling.factor", 1.0)),
        "original_max_position_embeddings": int(get("rope.scaling.original_context_length", 4096)),
        "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
        "truncate": False,
    }


def _check_tensors(file_name: str, tensors: Tensors, config: dict[str, Any]) -> None:
    """Every layer holds its attention (with biases and sinks), norms and experts' biases
    in the sizes the metadata gives."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim, kv = config["head_dim"], config["num_key_value_heads"]
    experts, width = config["num_local_experts"], config["intermediate_size"]
    rows = {"attn_q": heads * head_dim, "attn_k": kv * head_dim, "attn_v": kv * head_dim}
    for layer in range(config["num_hidden_layers"]):
        shapes: dict[str, tuple[int, ...]] = {name: (hidden,) for name in LAYER_TENSORS}
        shapes["attn_sinks.weight"] = (heads,)
        for name, count in rows.items():
            shapes[f"{name}.weight"] = (count, hidden)
            shapes[f"{name}.bias"] = (count,)
        shapes["attn_output.weight"] = (hidden, heads * head_dim)
        shapes["attn_output.bias"] = (hidden,)
        shapes["ffn_gate_inp.bias"] = (experts,)
        shapes["ffn_gate_exps.bias"] = (experts, width)
        shapes["ffn_up_exps.bias"] = (experts, width)
        shapes["ffn_down_exps.bias"] = (experts, hidden)
        check_layer_shapes(file_name, tensors, layer, shapes)
