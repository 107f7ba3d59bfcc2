"""Every tiny checkpoint the suite runs: each family's configuration as data, one builder
(``build_checkpoint``, seed, dtype and config changes as parameters), the draft heads
in the layouts they are published in, and resharded copies."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

# The dense families' shared shape.
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    initializer_range=0.2,  # sharp logits: greedy choices are not near-ties
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)

# DeepSeek: MLA with kv_lora_rank (24) unlike qk_rope_head_dim (8), so the cache's two
# parts cannot be swapped unnoticed; 8 routed experts in 2 groups, 1 shared, layer 0
# dense. V3.2's indexer keeps 6 tokens, fewer than most prompts, and has 16 heads: with
# few heads a key's weighted ReLU score is exactly 0 often enough for the top-k to tie.
DEEPSEEK_TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    kv_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=10,
    max_position_embeddings=512,
    initializer_range=0.2,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)
DEEPSEEK = {
    "deepseek-v3": dict(q_lora_rank=16),
    "deepseek-v3-no-q-lora": dict(q_lora_rank=None),
    "deepseek-v3.2": dict(q_lora_rank=16, index_topk=6, index_head_dim=16, index_n_heads=16),
    # V2-Lite's attention (no q_lora); the softmax router, group-limited
    "deepseek-v2": dict(q_lora_rank=None, topk_method="group_limited_greedy"),
}

WINDOW = 8  # shorter than three of the four PROMPTS of tests/test_reference_models.py

GEMMA3_TEXT = dict(
    **{**TINY, "num_hidden_layers": 4},
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    query_pre_attn_scalar=24,
    # Bases far apart: a sliding layer turned with the global base is caught.
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    final_logit_softcapping=30.0,
)


def gemma4_assistant(target: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A tiny Gemma 4 assistant's config for a target whose text config is ``target``:
    the target's widths where it reads the target (its hidden states, vocabulary, each
    layer kind's head size, KV heads, window and RoPE), a narrower width of its own, and
    one layer of each kind. ``changes``: top-level fields (``use_ordered_embeddings``)."""
    text = dict(
        vocab_size=target["vocab_size"],
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=target["num_key_value_heads"],
        head_dim=target["head_dim"],
        global_head_dim=target.get("global_head_dim", target["head_dim"]),
        num_global_key_value_heads=target.get("num_global_key_value_heads"),
        attention_k_eq_v=target.get("attention_k_eq_v", False),
        sliding_window=target["sliding_window"],
        layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        rope_parameters=target["rope_parameters"],
        max_position_embeddings=target["max_position_embeddings"],
        initializer_range=0.2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return {
        "text_config": text,
        "backbone_hidden_size": target["hidden_size"],
        "use_ordered_embeddings": False,
        "num_centroids": 16,  # of 16 tokens each; the best 4 scored per row
        "centroid_intermediate_top_k": 4,
        **changes,
    }


# Gemma 4's E-style text model: layers 4 and 5 read the KV of layers 2 (sliding) and 3
# (full) and have double-wide MLPs; full layers have heads of their own (32 values, one
# KV head, values are keys) and proportional RoPE turning a quarter of their
# frequencies; per-layer inputs of 8 values.
GEMMA4_TEXT = dict(
    **{**TINY, "num_hidden_layers": 6, "intermediate_size": 64},
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention"] * 3,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000.0,
        },
    },
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=256,
    final_logit_softcapping=30.0,
    tie_word_embeddings=False,  # tied, the tiny model mostly repeats its last token
)

# Qwen3.5's hybrid decoder: layers 0-2 Gated DeltaNet (2 key heads serving 4 value
# heads), layer 3 gated full attention.
QWEN35_TEXT = dict(
    **{**TINY, "num_hidden_layers": 4, "intermediate_size": 96, "initializer_range": 0.1},
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
QWEN35_EXPERTS = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)

# gpt-oss: a sliding layer (window shorter than most prompts), then a full one; 4 experts
# of 32 rows, 2 per token, float; YaRN (not truncated) over an original context of 32
# positions, which the prompts and decodes run past; a SwiGLU clamp low enough to bite.
GPT_OSS = dict(
    **{**TINY, "intermediate_size": 32},
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention"],
    attention_bias=True,
    swiglu_limit=2.0,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 16.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 32,
    },
)

# EAGLE-1 heads: one Llama layer; the target's width and vocabulary come from its config.
EAGLE_HEAD = dict(
    intermediate_size=96,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def _longrope(partial: float, original: int = 32) -> dict[str, Any]:
    """LongRoPE over an original context of ``original`` positions: short and long
    factors drawn from a generator of their own for the rotated part of each head
    (``partial``)."""
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    half = int(head_dim * partial) // 2
    generator = torch.Generator().manual_seed(1)
    short = (1 + torch.rand(half, generator=generator)).tolist()
    long = (1 + 6 * torch.rand(half, generator=generator)).tolist()
    return dict(
        original_max_position_embeddings=original,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": short,
            "long_factor": long,
            "partial_rotary_factor": partial,
            "original_max_position_embeddings": original,
        },
    )


# -- what a family's models get after initialisation --------------------------------------


def _score_biases(model: nn.Module) -> None:
    """DeepSeek's router score biases, drawn large enough to change which experts win."""
    for name, tensor in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            tensor.normal_(0, 0.5)


def _routers(model: nn.Module) -> None:
    """MoE routers with sharp, distinct choices."""
    for name, param in model.named_parameters():
        if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            param.normal_(0, 1.0)


def _gemma_norms(model: nn.Module) -> None:
    """Gemma's norms start at 0 (a scale of 1 + 0): random ones show a norm mixed up."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.normal_(0, 0.3)


def _assistant_params(model: nn.Module) -> None:
    """Gemma 4's norms scale by their weight (from 1) and its layer scalars start at 1:
    drawn, a norm or scalar mixed up shows; the centroid head's token order drawn as a
    permutation, so clusters are not runs of ids."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.normal_(1.0, 0.3)
    for name, buffer in model.named_buffers():
        if name.endswith("layer_scalar"):
            buffer.uniform_(0.5, 1.5)
        elif name.endswith("token_ordering"):
            buffer.copy_(torch.randperm(buffer.numel()))


def _gemma4_params(model: nn.Module) -> None:
    """Gemma 4's norms scale by their weight and each layer's output by its scalar, all
    1 at first: drawn, a norm or scalar mixed up or left out shows."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.normal_(1.0, 0.3)
        elif name.endswith(("router.scale", "per_expert_scale")):
            param.uniform_(0.5, 1.5)
        elif name.endswith("router.proj.weight"):
            param.normal_(0, 1.0)
    for name, buffer in model.named_buffers():
        if name.endswith("layer_scalar"):
            buffer.uniform_(0.5, 1.5)


def _hybrid_params(model: nn.Module) -> None:
    """Qwen3.5's (1 + w) norms and the DeltaNet's decays start at fixed values, and its
    routers near ties: drawn, a norm's offset, a decay's sign or an expert mixed up shows."""
    for name, param in model.named_parameters():
        if "norm" in name or name.endswith(("dt_bias", "A_log")):
            param.normal_(0, 0.3)
        elif name.endswith("mlp.gate.weight"):
            param.normal_(0, 1.0)


def _gpt_oss_params(model: nn.Module) -> None:
    """gpt-oss's expert biases start at 0 and its sinks and router near it: drawn, a bias,
    a sink or a routing mixed up shows."""
    for name, param in model.named_parameters():
        if name.endswith(("sinks", "router.weight", "router.bias")):
            param.normal_(0, 1.0)
        elif name.endswith("proj_bias"):
            param.normal_(0, 0.5)


@dataclass(frozen=True)
class Family:
    """transformers' config and model class names, the tiny config, and what is drawn
    into the model after its initialisation (under the same seed)."""

    config_class: str
    model_class: str
    config: dict[str, Any]
    sharpen: Callable[[nn.Module], None] | None = None


def _dense(name: str, **config: Any) -> Family:
    return Family(f"{name}Config", f"{name}ForCausalLM", {**TINY, **config})


def _deepseek(name: str, kind: str) -> Family:
    config = {**DEEPSEEK_TINY, **DEEPSEEK[kind]}
    return Family(f"{name}Config", f"{name}ForCausalLM", config, _score_biases)


FAMILIES: dict[str, Family] = {
    # GQA with Llama 3 RoPE scaling and untied embeddings
    "llama": _dense(
        "Llama",
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # MQA, tied embeddings, q/k/v bias
    "qwen2": _dense("Qwen2", num_key_value_heads=1, tie_word_embeddings=True),
    # MHA, per-head q/k norm, explicit head_dim
    "qwen3": _dense("Qwen3", num_key_value_heads=4, head_dim=32, tie_word_embeddings=False),
    # GQA, untied, no RoPE scaling: the shapes every weight format can write
    "llama-plain": _dense("Llama", num_key_value_heads=2, tie_word_embeddings=False),
    "qwen2-plain": _dense("Qwen2", num_key_value_heads=2, tie_word_embeddings=False),
    "qwen3-plain": _dense("Qwen3", num_key_value_heads=2, tie_word_embeddings=False),
    # wide enough for 4-bit groups of 32 and 64 along every linear's inputs
    "llama-wide": _dense("Llama", hidden_size=128, intermediate_size=256, num_key_value_heads=2),
    "qwen2-wide": _dense("Qwen2", hidden_size=128, intermediate_size=256, num_key_value_heads=2),
    "deepseek-v2": _deepseek("DeepseekV2", "deepseek-v2"),
    "deepseek-v3": _deepseek("DeepseekV3", "deepseek-v3"),
    "deepseek-v3-no-q-lora": _deepseek("DeepseekV3", "deepseek-v3-no-q-lora"),
    "deepseek-v3.2": _deepseek("DeepseekV32", "deepseek-v3.2"),
    # layers 0 and 2 dense (mlp_only_layers, then decoder_sparse_step 2 leaves odd ones)
    "qwen3-moe": Family(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            **TINY,
            "num_hidden_layers": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        },
        _routers,
    ),
    "qwen3-moe-unnormalised": Family(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            **TINY,
            "num_key_value_heads": 4,
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 24,
            "norm_topk_prob": False,
            "tie_word_embeddings": True,
        },
        _routers,
    ),
    # a gated shared expert of its own width beside 8 routed experts; layer 1 dense
    # (decoder_sparse_step 1, mlp_only_layers)
    "qwen2-moe": Family(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            **TINY,
            "num_hidden_layers": 3,
            "num_key_value_heads": 2,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 96,
            "mlp_only_layers": [1],
            "norm_topk_prob": False,
            "tie_word_embeddings": False,
        },
        _routers,
    ),
    "mixtral": Family(
        "MixtralConfig",
        "MixtralForCausalLM",
        {**TINY, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
        _routers,
    ),
    # LongRoPE, its original context 32 positions
    "phi3": _dense("Phi3", num_key_value_heads=2, sliding_window=None, **_longrope(1.0)),
    # partial rotary, tied embeddings
    "phi4-mini": _dense(
        "Phi3",
        num_key_value_heads=2,
        sliding_window=None,
        tie_word_embeddings=True,
        **_longrope(0.75),
    ),
    "mistral-window": _dense("Mistral", num_key_value_heads=2, sliding_window=WINDOW),
    # only layer 0 slides (max_window_layers), over a window of its own
    "qwen2-window": _dense(
        "Qwen2",
        num_hidden_layers=3,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=WINDOW - 2,
        max_window_layers=1,
    ),
    "phi3-window": _dense("Phi3", num_key_value_heads=2, sliding_window=WINDOW),
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3_TEXT, _gemma_norms),
    "gemma4": Family("Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4_TEXT, _gemma4_params),
    # experts beside every layer's MLP
    "gemma4-moe": Family(
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        {
            **GEMMA4_TEXT,
            "enable_moe_block": True,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
        },
        _gemma4_params,
    ),
    "qwen3.5": Family("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", QWEN35_TEXT, _hybrid_params),
    # every layer's MLP experts with a gated shared expert
    "qwen3.5-moe": Family(
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        {**QWEN35_TEXT, **QWEN35_EXPERTS},
        _hybrid_params,
    ),
    # DeltaNet projections interleaved per key head; layers 1 and 3 full attention
    # (full_attention_interval), layer 2 dense (mlp_only_layers)
    "qwen3-next": Family(
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {**QWEN35_TEXT, **QWEN35_EXPERTS, "full_attention_interval": 2, "mlp_only_layers": [2]},
        _hybrid_params,
    ),
    # the text tower above with a tiny vision tower: updraft serves the text tower
    "qwen3.5-multimodal": Family(
        "Qwen3_5Config",
        "Qwen3_5ForConditionalGeneration",
        {
            "text_config": QWEN35_TEXT,
            "vision_config": dict(
                depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64
            ),
        },
        _hybrid_params,
    ),
    "gpt-oss": Family("GptOssConfig", "GptOssForCausalLM", GPT_OSS, _gpt_oss_params),
    # Gemma 4's assistant drafter, over the gemma4 target's widths
    "gemma4-assistant": Family(
        "Gemma4AssistantConfig",
        "Gemma4AssistantForCausalLM",
        gemma4_assistant(GEMMA4_TEXT),
        _assistant_params,
    ),
    # the text tower above with a tiny vision tower: updraft serves the text tower
    "gemma3-multimodal": Family(
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        {
            "text_config": GEMMA3_TEXT,
            "vision_config": dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ),
            "mm_tokens_per_image": 4,
        },
        _gemma_norms,
    ),
    # the Gemma 4 text tower above with tiny vision and audio towers: updraft serves the
    # text tower
    "gemma4-multimodal": Family(
        "Gemma4Config",
        "Gemma4ForConditionalGeneration",
        {
            # the multimodal forward masks its media tokens with the pad token
            "text_config": {**GEMMA4_TEXT, "pad_token_id": 0},
            "vision_config": dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=8,
                patch_size=4,
                pooling_kernel_size=2,
                position_embedding_size=64,
            ),
            "audio_config": dict(
                hidden_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                subsampling_conv_channels=[4, 4],
                output_proj_dims=16,
            ),
        },
        _gemma4_params,
    ),
}


# -- the builder ---------------------------------------------------------------------------


def tiny_config(kind: str, **changes: Any):
    """transformers' config of ``kind``, with ``changes`` over its tiny values."""
    import transformers

    family = FAMILIES[kind]
    # a copy: transformers may standardise nested values (RoPE's) in place
    values = copy.deepcopy({**family.config, **changes})
    return getattr(transformers, family.config_class)(**values)


def tiny_model(
    kind: str,
    *,
    seed: int | None = 0,
    dtype: torch.dtype = torch.float32,
    sharpen: bool = True,
    **changes: Any,
) -> nn.Module:
    """A random model of ``kind`` drawn under ``seed`` (None: the global generator as it
    stands); ``sharpen=False`` keeps transformers' own initialisation throughout."""
    import transformers

    family = FAMILIES[kind]
    config = tiny_config(kind, **changes)
    if seed is not None:
        torch.manual_seed(seed)
    model = getattr(transformers, family.model_class)(config)
    if sharpen and family.sharpen is not None:
        with torch.no_grad():
            family.sharpen(model)
    return model.to(dtype).eval()


def saved_model(kind: str, directory: Path, **changes: Any) -> nn.Module:
    """A random ``kind`` model (see ``tiny_model``), saved in ``directory`` as
    transformers does: the reference and its checkpoint."""
    model = tiny_model(kind, **changes)
    model.save_pretrained(directory)
    return model


def build_checkpoint(
    kind: str,
    directory: Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    sharpen: bool = True,
    **changes: Any,
) -> Path:
    """Save a random ``kind`` model (see ``tiny_model``) in ``directory`` as transformers
    does (a kind of ``MXFP4_KINDS``: its float kind, its experts then quantized)."""
    if kind in MXFP4_KINDS:
        build_checkpoint(MXFP4_KINDS[kind], directory, seed=seed, dtype=dtype, **changes)
        return write_mxfp4_experts(directory)
    tiny_model(kind, seed=seed, dtype=dtype, sharpen=sharpen, **changes).save_pretrained(directory)
    return directory


def sharded_copy(source: Path, directory: Path, max_shard_size: str = "40KB") -> Path:
    """``source`` saved again in shards of at most ``max_shard_size``, with an index."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


# -- draft heads in their published layouts ------------------------------------------------


def eagle_head_checkpoint(directory: Path, target_dir: Path, seed: int = 1) -> Path:
    """A random one-layer EAGLE-1 head for ``target_dir``: fc with a bias, layer 0
    without an input norm, and a copy of an embedding (published heads carry one) that
    must not be read."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    target = json.loads((target_dir / "config.json").read_text())
    config = transformers.LlamaConfig(
        hidden_size=target["hidden_size"], vocab_size=target["vocab_size"], **EAGLE_HEAD
    )
    torch.manual_seed(seed)
    layer = LlamaDecoderLayer(config, 0)
    fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
    tensors = {"fc.weight": fc.weight, "fc.bias": fc.bias}
    for name, tensor in layer.state_dict().items():
        if name.startswith("input_layernorm."):
            continue
        if "layernorm" in name:
            tensor = 1 + 0.2 * torch.randn_like(tensor)
        tensors[f"layers.0.{name}"] = tensor
    tensors["embed_tokens.weight"] = torch.randn(config.vocab_size, config.hidden_size)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: t.detach().contiguous() for name, t in tensors.items()},
        directory / "model.safetensors",
        metadata={"format": "pt"},
    )
    raw = config.to_dict()
    raw.update(architectures=["LlamaForCausalLM"], torch_dtype="float32", bias=True)
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def mtp_checkpoint(directory: Path, kind: str = "deepseek-v3") -> Path:
    """Save a tiny V3 (or V3.2) main model, then write a random MTP layer beside it
    under the names DeepSeek's checkpoints use: the block's tensors at the layer's top
    level, ``shared_head.norm`` for the output norm, one tensor per expert."""
    if kind == "deepseek-v3":
        main = tiny_model(kind, sharpen=False, num_nextn_predict_layers=1)
        main.save_pretrained(directory)
        block = _mtp_block_of_v3(main)
    else:
        build_checkpoint(kind, directory)
        raw = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
        block = _mtp_block_of_v32()
    layer = DEEPSEEK_TINY["num_hidden_layers"]
    tensors = load_file(directory / "model.safetensors")
    prefix = f"model.layers.{layer}."
    for rest, tensor in block.items():
        if rest.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            for expert in range(tensor.shape[0]):
                tensors[f"{prefix}mlp.experts.{expert}.gate_proj.weight"] = gate[expert].clone()
                tensors[f"{prefix}mlp.experts.{expert}.up_proj.weight"] = up[expert].clone()
        elif rest.endswith("experts.down_proj"):
            for expert in range(tensor.shape[0]):
                tensors[f"{prefix}mlp.experts.{expert}.down_proj.weight"] = tensor[expert].clone()
        else:
            tensors[prefix + rest] = tensor.clone().contiguous()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def _randomized(module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """``module``'s tensors, parameters drawn from N(0, 0.2) and the routers' score
    biases from N(0, 0.5) (so that they change which experts win)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for tensor in module.parameters():
            tensor.normal_(0, 0.2)
        _score_biases(module)
    return module.state_dict()


def _mtp_block_of_v3(main: nn.Module) -> dict[str, torch.Tensor]:
    """transformers' own MTP layer for ``main``, under the names of the layer's top
    level in DeepSeek's checkpoints."""
    from transformers.modeling_layers import MtpModel

    tensors = _randomized(MtpModel(main, 1).layers[0], seed=1)
    return {
        name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm."): tensor
        for name, tensor in tensors.items()
    }


def _mtp_block_of_v32() -> dict[str, torch.Tensor]:
    """A V3.2 MTP layer: a decoder block with experts and the indexer (transformers has
    no MTP layer for V3.2: its block comes from a V3.2 model one layer deeper) and the
    depth's own norms and projection."""
    layers = DEEPSEEK_TINY["num_hidden_layers"]
    deeper = tiny_model("deepseek-v3.2", seed=None, sharpen=False, num_hidden_layers=layers + 1)
    tensors = _randomized(deeper.model.layers[layers], seed=1)
    hidden = DEEPSEEK_TINY["hidden_size"]
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{name}.weight"] = 1 + 0.2 * torch.randn(hidden)
    tensors["eh_proj.weight"] = 0.2 * torch.randn(hidden, 2 * hidden)
    return tensors


# -- gpt-oss's experts as OpenAI publishes them: MXFP4 blocks ----------------------------

# A kind whose experts are written in MXFP4, and the float kind it is drawn as.
MXFP4_KINDS = {"gpt-oss-mxfp4": "gpt-oss"}
# What stays unquantized in a published gpt-oss checkpoint (its quantization_config).
MXFP4_KEPT = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]


def mxfp4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., K] quantized by llama.cpp's MXFP4 quantizer (the gguf package's),
    laid out as transformers' checkpoints hold it: blocks [..., K / 32, 16] with codes
    2j and 2j + 1 in byte j's low and high nibbles (ggml puts j and j + 16 there), and
    scales [..., K / 32]."""
    from gguf import GGMLQuantizationType, quants

    *outer, k = weight.shape
    flat = weight.reshape(-1, k).float().numpy()
    ggml = quants.quantize(flat, GGMLQuantizationType.MXFP4).reshape(*outer, k // 32, 17)
    scales, packed = ggml[..., 0], ggml[..., 1:]
    codes = np.concatenate([packed & 0xF, packed >> 4], axis=-1)  # [..., 32] in order
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(scales.copy())


def write_mxfp4_experts(directory: Path) -> Path:
    """The checkpoint in ``directory`` with its experts' weights (transformers' [E, in,
    out]) replaced by MXFP4 ``_blocks`` and ``_scales`` over their rows of outputs, and
    the ``quantization_config`` that says so."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4_blocks(tensors.pop(name).transpose(1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MXFP4_KEPT}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def built_once(tmp_path_factory: Any) -> Callable[[str], tuple[nn.Module, Path]]:
    """``get(kind)``: the reference model of ``kind`` and its checkpoint directory,
    built on first use and kept (a module-scoped fixture's body)."""
    built: dict[str, tuple[nn.Module, Path]] = {}

    def get(kind: str) -> tuple[nn.Module, Path]:
        if kind not in built:
            directory = tmp_path_factory.mktemp(kind)
            model = tiny_model(kind)
            model.save_pretrained(directory)
            built[kind] = model, directory
        return built[kind]

    return get
