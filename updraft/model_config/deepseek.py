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
