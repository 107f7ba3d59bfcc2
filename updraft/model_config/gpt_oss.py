"""OpenAI's gpt-oss config: Llama-style grouped-query attention with q/k/v/o biases and
a learned sink logit per head, sliding and full layers alternating (``layer_types``),
YaRN, and in every layer a mixture of experts whose router is biased and whose experts
use a clamped SwiGLU with biases."""

from __future__ import annotations

from typing import Any

from updraft.model_config.fields import decoder_fields, layer_windows, positive_int
from updraft.model_config.parts import MoEConfig

# What a config leaves out takes transformers' GptOssConfig defaults.
DEFAULTS = {
    "rope_theta": 150_000.0,
    "rms_norm_eps": 1e-5,
    "sliding_window": 128,
    "attention_bias": True,
    "head_dim": 64,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
}


def parse(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """``ModelConfig`` fields of a gpt-oss config.json."""
    given = {key: value for key, value in raw.items() if value is not None}
    if "rope_scaling" in given and "rope_parameters" not in given:  # the published form
        given["rope_parameters"] = given.pop("rope_scaling")
    config = {**DEFAULTS, **given}
    fields = decoder_fields(config)

    def every_other_slides(layers: int) -> list[bool]:  # sliding first, as transformers'
        return [layer % 2 == 0 for layer in range(layers)]

    fields["layer_windows"] = layer_windows(config, every_other_slides)
    fields["attention_sinks"] = True
    fields["moe"] = _experts(config)
    return fields


def _experts(config: dict[str, Any]) -> MoEConfig:
    """Every layer's experts: the router's top k of its logits, softmaxed over those k;
    each expert intermediate_size wide."""
    num_experts = positive_int(config, "num_local_experts")
    top_k = positive_int(config, "num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(
            f"config.json: num_experts_per_tok {top_k} is more than the {num_experts} experts"
        )
    limit, alpha = config["swiglu_limit"], config["swiglu_alpha"]
    for name, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"config.json: {name} must be a positive number, got {value!r}")
    return MoEConfig(
        hidden_size=positive_int(config, "hidden_size"),
        moe_intermediate_size=positive_int(config, "intermediate_size"),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        n_group=1,
        topk_group=1,
        n_shared_experts=0,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        scoring="softmax",
        group_score="max",
        swiglu_alpha=float(alpha),
        swiglu_limit=float(limit),
    )
