"""DeepSeek-V2, V3 and V3.2's configs: latent attention, a group-limited router over
routed and shared experts from layer ``first_k_dense_replace`` on, and (V3.2) the
sparse-attention indexer."""

from __future__ import annotations

from typing import Any

from updraft.model_config.fields import decoder_fields, positive_int, require_silu
from updraft.model_config.parts import IndexerConfig, MLAConfig, MoEConfig


def parse(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """``ModelConfig`` fields of a DeepSeek config.json."""
    require_silu(raw)
    mla = _latent_attention(raw, architecture)
    moe = _experts(raw, architecture)
    indexer = _indexer(raw, mla) if architecture == "DeepseekV32ForCausalLM" else None
    return {
        **decoder_fields(raw),
        "head_dim": mla.qk_rope_head_dim,  # the rotary part of a head is what RoPE turns
        "mla": mla,
        "moe": moe,
        "first_k_dense_replace": int(raw.get("first_k_dense_replace") or 0),
        "indexer": indexer,
        "mtp_layers": int(raw.get("num_nextn_predict_layers") or 0),
    }


def _latent_attention(raw: dict[str, Any], architecture: str) -> MLAConfig:
    if raw.get("attention_bias"):
        raise ValueError("config.json: DeepSeek attention with attention_bias is not supported")
    q_lora_rank = raw.get("q_lora_rank")
    if q_lora_rank is not None:
        q_lora_rank = positive_int(raw, "q_lora_rank")
    mla = MLAConfig(
        q_lora_rank=q_lora_rank,
        kv_lora_rank=positive_int(raw, "kv_lora_rank"),
        qk_nope_head_dim=positive_int(raw, "qk_nope_head_dim"),
        qk_rope_head_dim=positive_int(raw, "qk_rope_head_dim"),
        v_head_dim=positive_int(raw, "v_head_dim"),
        # V2 and V3.2 always interleave; V3 says so in its config (default true).
        rope_interleave=architecture != "DeepseekV3ForCausalLM"
        or bool(raw.get("rope_interleave", True)),
    )
    if mla.qk_rope_head_dim % 2:
        raise ValueError(f"config.json: qk_rope_head_dim must be even, got {mla.qk_rope_head_dim}")
    return mla


def _experts(raw: dict[str, Any], architecture: str) -> MoEConfig:
    num_experts = positive_int(raw, "n_routed_experts")
    v2 = architecture == "DeepseekV2ForCausalLM"
    n_group, topk_group = raw.get("n_group") or 1, raw.get("topk_group") or 1
    if v2:
        method = raw.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"config.json: DeepSeek-V2 topk_method {method!r} is not supported "
                "(greedy, group_limited_greedy are)"
            )
        if method == "greedy":  # every expert in one group
            n_group = topk_group = 1
    if num_experts % n_group:
        raise ValueError(
            f"config.json: n_routed_experts {num_experts} is not a multiple of n_group {n_group}"
        )
    if not v2 and num_experts // n_group < 2:
        raise ValueError(
            "config.json: each expert group needs at least 2 experts (groups rank by their top two)"
        )
    moe = MoEConfig(
        hidden_size=positive_int(raw, "hidden_size"),
        moe_intermediate_size=positive_int(raw, "moe_intermediate_size"),
        num_experts=num_experts,
        num_experts_per_tok=positive_int(raw, "num_experts_per_tok"),
        n_group=n_group,
        topk_group=topk_group,
        n_shared_experts=raw.get("n_shared_experts") or 0,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        # V2's router never normalises its top-k weights, whatever the config says.
        norm_topk_prob=not v2 and bool(raw.get("norm_topk_prob", True)),
        scoring="softmax" if v2 else "sigmoid",
        group_score="max" if v2 else "top2_sum",
    )
    if moe.topk_group > n_group or moe.num_experts_per_tok > moe.topk_group * (
        num_experts // n_group
    ):
        raise ValueError(
            f"config.json: num_experts_per_tok {moe.num_experts_per_tok} experts cannot be chosen "
            f"from topk_group {moe.topk_group} of {n_group} groups of {num_experts // n_group}"
        )
    return moe


def _indexer(raw: dict[str, Any], mla: MLAConfig) -> IndexerConfig:
    if mla.q_lora_rank is None:
        raise ValueError(
            "config.json: DeepSeek-V3.2 needs q_lora_rank (its indexer reads the query latent)"
        )
    indexer = IndexerConfig(
        n_heads=positive_int(raw, "index_n_heads"),
        head_dim=positive_int(raw, "index_head_dim"),
        topk=positive_int(raw, "index_topk"),
    )
    if indexer.head_dim < mla.qk_rope_head_dim:
        raise ValueError("config.json: index_head_dim must be at least qk_rope_head_dim")
    return indexer


# -- from a GGUF file's metadata ---------------------------------------------------------

# llama.cpp's expert_gating_func values (its LLAMA_EXPERT_GATING_FUNC_TYPE_*).
GATING_FUNCS = {1: "softmax", 2: "sigmoid", 4: "sqrtsoftplus"}


def from_gguf(
    file_name: str,
    architecture: str,
    get: Any,
    tensors: dict[str, tuple[str, tuple[int, ...]]],
) -> dict[str, Any]:
    """The config.json that transformers would write for a ``deepseek2`` GGUF file, which
    V2 and V3 both are: a sigmoid router (``expert_gating_func``) makes it V3, a softmax
    one (or none named, as in V2's first files) V2. ``get(key, default)`` reads the
    file's ``deepseek2.<key>`` metadata; ``architecture`` (the registry row's) is not
    what decides."""

    def need(key: str) -> Any:
        value = get(key)
        if value is None:
            raise ValueError(f"{file_name}: the GGUF metadata lacks {key}, which DeepSeek needs")
        return value

    if get("nextn_predict_layers"):
        raise ValueError(
            f"{file_name}: multi-token prediction layers (nextn_predict_layers) in a GGUF "
            "file are not read yet"
        )
    heads = int(need("attention.head_count"))
    config: dict[str, Any] = {
        "vocab_size": tensors["token_embd.weight"][1][0],
        "hidden_size": int(need("embedding_length")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,  # the file's 1 is MLA's shared latent
        "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        **_gguf_latent_attention(file_name, need, get, tensors),
        **_gguf_experts(file_name, need, get, tensors),
    }
    rope_scaling = _gguf_yarn(file_name, need, get)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _gguf_latent_attention(file_name: str, need, get, tensors) -> dict[str, Any]:
    """MLA's sizes. Files written since llama.cpp splits ``attn_kv_b`` into ``attn_k_b``
    and ``attn_v_b`` give a head's sizes as ``key_length_mla``/``value_length_mla``
    (their ``key_length``/``value_length`` are the latent's); older ones, with the
    fused ``attn_kv_b``, as ``key_length``/``value_length``."""
    rope = int(need("rope.dimension_count"))
    if get("attention.key_length_mla") is not None:
        key, value = need("attention.key_length_mla"), need("attention.value_length_mla")
    else:
        key, value = need("attention.key_length"), need("attention.value_length")
    if int(key) <= rope:
        raise ValueError(
            f"{file_name}: a head's key length {key} leaves no room beside its "
            f"{rope} rotary dimensions (rope.dimension_count)"
        )
    q_lora_rank = get("attention.q_lora_rank")
    if (q_lora_rank is not None) != ("blk.0.attn_q_a.weight" in tensors):
        raise ValueError(
            f"{file_name}: attention.q_lora_rank is {q_lora_rank} but blk.0.attn_q_a is "
            f"{'present' if 'blk.0.attn_q_a.weight' in tensors else 'absent'}"
        )
    return {
        "q_lora_rank": None if q_lora_rank is None else int(q_lora_rank),
        "kv_lora_rank": int(need("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(key) - rope,
        "v_head_dim": int(value),
        "rope_interleave": True,  # llama.cpp turns adjacent pairs, as V2 and V3 do
    }


def _gguf_experts(file_name: str, need, get, tensors) -> dict[str, Any]:
    """The router as transformers' V3 (sigmoid, a score bias ``exp_probs_b`` for
    choosing, top-k renormalised where ``expert_weights_norm`` says) or V2 (softmax,
    never renormalised) has it."""
    gating = get("expert_gating_func")
    scoring = "softmax" if gating is None else GATING_FUNCS.get(int(gating), str(gating))
    score_bias = any(name.endswith(".exp_probs_b.bias") for name in tensors)
    norm = bool(get("expert_weights_norm", False))
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(
            f"{file_name}: expert_gating_func {gating} ({scoring}) is not supported "
            "(1, softmax, and 2, sigmoid, are)"
        )
    if scoring == "softmax" and (score_bias or norm):
        what = "exp_probs_b score biases" if score_bias else "expert_weights_norm"
        raise ValueError(
            f"{file_name}: a softmax router (DeepSeek-V2's) with {what} is not supported"
        )
    n_group = int(get("expert_group_count") or 1)
    v3 = scoring == "sigmoid"
    method = "noaux_tc" if v3 else "group_limited_greedy" if n_group > 1 else "greedy"
    return {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "moe_intermediate_size": int(need("expert_feed_forward_length")),
        "n_routed_experts": int(need("expert_count")),
        "num_experts_per_tok": int(need("expert_used_count")),
        "n_shared_experts": int(get("expert_shared_count", 0)),
        "n_group": n_group,
        "topk_group": int(get("expert_group_used_count") or 1),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
        "norm_topk_prob": norm,
        "scoring_func": scoring,
        "topk_method": method,
    }


def _gguf_yarn(file_name: str, need, get) -> dict[str, Any] | None:
    """DeepSeek's YaRN: llama.cpp keeps RoPE's cos/sin unscaled (transformers'
    ``attention_factor`` 1) and stores ``mscale_all_dim`` times 0.1 as
    ``yarn_log_multiplier``, which scales the softmax by mscale squared."""
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise ValueError(f"{file_name}: DeepSeek RoPE scaling {kind!r} is not supported (yarn is)")
    for key in ("rope.scaling.yarn_attn_factor", "rope.scaling.yarn_ext_factor"):
        if float(get(key, 1.0)) != 1.0:
            raise ValueError(f"{file_name}: {key} {get(key)} is not supported (1.0 is)")
    scaling = {
        "rope_type": "yarn",
        "factor": float(need("rope.scaling.factor")),
        "original_max_position_embeddings": int(need("rope.scaling.original_context_length")),
        "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
        "attention_factor": 1.0,
    }
    log_multiplier = get("rope.scaling.yarn_log_multiplier")
    if log_multiplier:
        scaling["mscale_all_dim"] = float(log_multiplier) / 0.1
    return scaling
