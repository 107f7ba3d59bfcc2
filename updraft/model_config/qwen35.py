"""The hybrid Qwen families' configs: Qwen3.5, Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet
linear-attention layers between gated full-attention ones), and the text tower of
Qwen3.5's and Qwen3.5-MoE's multimodal checkpoints (config.json's ``text_config``)."""

from __future__ import annotations

from typing import Any

from updraft.model_config.fields import decoder_fields, positive_int, require_silu
from updraft.model_config.parts import LinearAttentionConfig, MoEConfig

MULTIMODAL = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
# Every layer routes to experts, renormalising the top k (Qwen3.5-MoE); experts where
# decoder_sparse_step and mlp_only_layers say, normalised as norm_topk_prob says
# (Qwen3-Next).
ALL_EXPERTS = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
SOME_EXPERTS = ("Qwen3NextForCausalLM",)
LAYER_KINDS = ("linear_attention", "full_attention")
# transformers' defaults for the fields these configs may leave out.
DEFAULT_PARTIAL_ROTARY = 0.25
DEFAULT_FULL_ATTENTION_INTERVAL = 4


def parse(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """``ModelConfig`` fields of a Qwen3.5, Qwen3.5-MoE or Qwen3-Next config.json."""
    text = _text_config(raw, architecture)
    require_silu(text)
    moe = architecture in ALL_EXPERTS or architecture in SOME_EXPERTS
    if moe and text.get("intermediate_size") is None:
        # Qwen3.5-MoE has no dense MLP: the field stands for nothing there.
        text = {**text, "intermediate_size": positive_int(text, "moe_intermediate_size")}
    fields = decoder_fields(text)
    fields["head_dim"] = positive_int(text, "head_dim")
    rope = fields["rope"]
    if rope.kind != "default":
        raise ValueError(
            f"config.json: rope_parameters.rope_type {rope.kind!r} is not supported for "
            f"{architecture} (default is)"
        )
    params = text.get("rope_parameters") or {}
    if params.get("partial_rotary_factor") is None and text.get("partial_rotary_factor") is None:
        fields["partial_rotary_factor"] = DEFAULT_PARTIAL_ROTARY
    fields.update(
        qk_norm=True,
        norm_offset=1.0,
        attention_output_gate=True,
        linear_attention=_linear_attention(text),
        linear_layers=_linear_layers(text, fields["num_layers"]),
        mtp_layers=int(text.get("mtp_num_hidden_layers") or 0),
    )
    if moe:
        fields.update(_experts(text, architecture, fields["num_layers"]))
    return fields


def _text_config(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The text model's fields: a multimodal checkpoint's ``text_config``, with the
    outer config's word of whether the LM head is the embedding (transformers ties by
    the outer config) and of the dtype where the text config names none."""
    if architecture not in MULTIMODAL:
        return raw
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"config.json of {architecture} lacks its text_config")
    text = {key: raw[key] for key in ("dtype", "torch_dtype") if key in raw} | text
    if "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return text


def _linear_attention(text: dict[str, Any]) -> LinearAttentionConfig:
    linear = LinearAttentionConfig(
        num_key_heads=positive_int(text, "linear_num_key_heads"),
        num_value_heads=positive_int(text, "linear_num_value_heads"),
        key_head_dim=positive_int(text, "linear_key_head_dim"),
        value_head_dim=positive_int(text, "linear_value_head_dim"),
        conv_kernel=positive_int(text, "linear_conv_kernel_dim"),
    )
    if linear.num_value_heads % linear.num_key_heads:
        raise ValueError(
            f"config.json: linear_num_value_heads {linear.num_value_heads} is not a multiple "
            f"of linear_num_key_heads {linear.num_key_heads}: each key head serves a whole "
            "number of value heads"
        )
    if linear.conv_kernel < 2:
        raise ValueError(
            f"config.json: linear_conv_kernel_dim must be at least 2, got {linear.conv_kernel}"
        )
    return linear


def _linear_layers(text: dict[str, Any], num_layers: int) -> frozenset[int]:
    """The Gated DeltaNet layers: as ``layer_types`` lists them, else transformers'
    pattern (every ``full_attention_interval``-th layer is full attention)."""
    kinds = text.get("layer_types")
    if kinds is None:
        interval = text.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(
                f"config.json: full_attention_interval must be a positive int, got {interval!r}"
            )
        return frozenset(i for i in range(num_layers) if (i + 1) % interval)
    if not isinstance(kinds, list) or len(kinds) != num_layers or not set(kinds) <= {*LAYER_KINDS}:
        raise ValueError(
            f"config.json: layer_types must list one of {', '.join(LAYER_KINDS)} for each of "
            f"the {num_layers} layers, got {kinds!r}"
        )
    return frozenset(i for i, kind in enumerate(kinds) if kind == "linear_attention")


def _experts(text: dict[str, Any], architecture: str, num_layers: int) -> dict[str, Any]:
    """The softmax top-k mixture and its one shared expert, gated by a sigmoid."""
    num_experts = positive_int(text, "num_experts")
    moe = MoEConfig(
        hidden_size=positive_int(text, "hidden_size"),
        moe_intermediate_size=positive_int(text, "moe_intermediate_size"),
        num_experts=num_experts,
        num_experts_per_tok=positive_int(text, "num_experts_per_tok"),
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=architecture in ALL_EXPERTS or bool(text.get("norm_topk_prob", True)),
        scoring="softmax",
        group_score="max",
        shared_intermediate_size=positive_int(text, "shared_expert_intermediate_size"),
        shared_expert_gate=True,
    )
    if moe.num_experts_per_tok > num_experts:
        raise ValueError(
            f"config.json: num_experts_per_tok {moe.num_experts_per_tok} is more than the "
            f"{num_experts} experts"
        )
    dense: frozenset[int] = frozenset()
    if architecture in SOME_EXPERTS:
        step = text.get("decoder_sparse_step") or 1
        only_mlp = set(text.get("mlp_only_layers") or ())
        dense = frozenset(i for i in range(num_layers) if i in only_mlp or (i + 1) % step)
    return {"moe": moe, "dense_layers": dense}
