"""The config.json of a Qwen3.5, Qwen3.5-MoE or Qwen3-Next GGUF file (llama.cpp's
``qwen35``, ``qwen35moe`` and ``qwen3next``), as transformers would write it for the
checkpoint the file came from, checked against the file's tensors before anything loads.

llama.cpp names the Gated DeltaNet sizes as its Mamba layers': ``ssm.group_count`` key
heads of ``ssm.state_size`` values, ``ssm.time_step_rank`` value heads sharing
``ssm.inner_size`` values, a causal conv of ``ssm.conv_kernel`` taps;
``attention.recurrent_layers`` marks the linear layers (older files give only
``full_attention_interval``: every n-th layer is full attention). A file with
multi-token prediction layers counts them in ``block_count`` and says how many in
``nextn_predict_layers``; they come after the decoder layers. A ``qwen3next`` file is
read as Qwen3.5-MoE, the same decoder: its converter splits Qwen3-Next's per-key-head
projections into Qwen3.5's layout, and llama.cpp renormalises both families' top k. The
query rows of a full
attention layer are twice its heads (each head's query, then its output gate), as in
transformers' checkpoints; the rotary share of a head is ``rope.dimension_count``.

How the tensors are stored (names, the converter's changes to their values) is for
``models/gguf_linear_attention.py``; ``GGUF_TENSORS`` here is the names' part.
"""

from __future__ import annotations

from typing import Any

from updraft.model_config.fields import gguf_decoder_fields
from updraft.model_config.gguf_experts import read_experts
from updraft.model_config.qwen35 import ALL_EXPERTS, SOME_EXPERTS

Tensors = dict[str, tuple[str, tuple[int, ...]]]  # name -> (type, shape, rows first)

# llama.cpp's names of the linear-attention tensors (and the MLP's norm) -> transformers'
# Qwen3.5 names; Qwen3-Next's fused ssm_ba is split into ssm_beta and ssm_alpha first.
GGUF_TENSORS = (
    (r"blk\.(\d+)\.attn_qkv\.weight", r"model.layers.\1.linear_attn.in_proj_qkv.weight"),
    (r"blk\.(\d+)\.attn_gate\.weight", r"model.layers.\1.linear_attn.in_proj_z.weight"),
    (r"blk\.(\d+)\.ssm_beta\.weight", r"model.layers.\1.linear_attn.in_proj_b.weight"),
    (r"blk\.(\d+)\.ssm_alpha\.weight", r"model.layers.\1.linear_attn.in_proj_a.weight"),
    (r"blk\.(\d+)\.ssm_a", r"model.layers.\1.linear_attn.A_log"),
    (r"blk\.(\d+)\.ssm_dt\.bias", r"model.layers.\1.linear_attn.dt_bias"),
    (r"blk\.(\d+)\.ssm_conv1d\.weight", r"model.layers.\1.linear_attn.conv1d.weight"),
    (r"blk\.(\d+)\.ssm_norm\.weight", r"model.layers.\1.linear_attn.norm.weight"),
    (r"blk\.(\d+)\.ssm_out\.weight", r"model.layers.\1.linear_attn.out_proj.weight"),
    (
        r"blk\.(\d+)\.post_attention_norm\.weight",
        r"model.layers.\1.post_attention_layernorm.weight",
    ),
)
# What a linear layer must hold; its beta and alpha rows as two tensors or (Qwen3-Next) one.
LINEAR_TENSORS = (
    "ssm_conv1d.weight",
    "ssm_a",
    "ssm_dt.bias",
    "ssm_norm.weight",
    "ssm_out.weight",
)
SEPARATE_BETA_ALPHA = ("ssm_beta.weight", "ssm_alpha.weight")
# Its q/k/v and z rows as two tensors or (early Qwen3-Next files: transformers' own
# in_proj_qkvz) one.
SEPARATE_QKVZ = ("attn_qkv.weight", "attn_gate.weight")
FUSED_QKVZ = "ssm_in.weight"
FUSED_BETA_ALPHA = ("ssm_ba.weight", "ssm_beta_alpha.weight")  # the converter's, early files
FULL_TENSORS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")
# The families with experts (the parser's lists); Qwen3-Next's files are read as the
# first's (see _expert_fields).
MIXTURES = (*ALL_EXPERTS, *SOME_EXPERTS)
# The MRoPE sections transformers' Qwen3.5 config states (text positions turn them alike).
MROPE_SECTION = [11, 11, 10]


def from_gguf(file_name: str, architecture: str, get: Any, tensors: Tensors) -> dict[str, Any]:
    """The config.json of a hybrid file: ``get(key, default)`` reads its ``<arch>.<key>``
    metadata. A missing or inconsistent size, or a layer without one of its tensors, is
    refused naming it."""

    def need(key: str) -> int:
        value = get(key)
        if value is None:
            raise ValueError(f"{file_name}: the GGUF metadata lacks {key}, which the model needs")
        if int(value) < 1:
            raise ValueError(f"{file_name}: {key} must be positive, got {value}")
        return int(value)

    for key in ("embedding_length", "attention.head_count"):
        need(key)
    blocks = need("block_count")
    mtp = int(get("nextn_predict_layers", 0) or 0)
    if not 0 <= mtp < blocks:
        raise ValueError(f"{file_name}: nextn_predict_layers {mtp} of {blocks} blocks")
    layers = blocks - mtp
    # A mixture of experts' file may state no dense width: gguf_decoder_fields reads one.
    dense = {"feed_forward_length": get("feed_forward_length") or 0}
    config = gguf_decoder_fields(
        architecture, lambda key, default=None: dense.get(key, get(key, default)), tensors
    )
    config["num_hidden_layers"] = layers
    heads = config["num_attention_heads"]
    head_dim = int(get("attention.key_length", config["hidden_size"] // heads))
    rotary = int(get("rope.dimension_count", head_dim))
    config["head_dim"] = head_dim
    config["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": config.pop("rope_theta"),
        "partial_rotary_factor": rotary / head_dim,
    }
    if get("rope.dimension_sections") is not None:
        config["rope_parameters"].update(mrope_section=MROPE_SECTION, mrope_interleaved=True)
    if mtp:
        config["mtp_num_hidden_layers"] = mtp
    linear = _linear_sizes(file_name, get, need)
    config.update(linear)
    config["layer_types"] = _layer_types(file_name, get, layers, blocks)
    _check_tensors(file_name, tensors, config, linear)
    config.update(_expert_fields(file_name, architecture, get, tensors, config))
    if not config["intermediate_size"]:
        del config["intermediate_size"]  # as transformers' Qwen3.5-MoE config has none
    return config


def _expert_fields(
    file_name: str, architecture: str, get: Any, tensors: Tensors, config: dict[str, Any]
) -> dict[str, Any]:
    """config.json's mixture of experts: every layer routed, with its gated shared
    expert, the top k renormalised (as llama.cpp's code runs both families). A
    ``qwen3next`` file is read as Qwen3.5-MoE: the same decoder, and the converter has
    already stored its projections in Qwen3.5's layout."""
    if architecture not in MIXTURES:
        if get("expert_count"):
            raise ValueError(f"{file_name}: expert_count in a file of dense {architecture}")
        if not config["intermediate_size"]:
            raise ValueError(f"{file_name}: the GGUF metadata lacks feed_forward_length")
        return {}
    experts = read_experts(file_name, get, tensors, config["num_hidden_layers"])
    if experts is None:
        raise ValueError(f"{file_name}: the GGUF metadata lacks expert_count")
    if experts.dense_layers:
        raise ValueError(
            f"{file_name}: layers {list(experts.dense_layers)} have no router "
            "(ffn_gate_inp); every layer of these files routes to experts"
        )
    if not experts.shared_width:
        raise ValueError(f"{file_name}: layer 0 has no shared expert (ffn_down_shexp)")
    fields: dict[str, Any] = {
        "architectures": [ALL_EXPERTS[0]],  # Qwen3.5-MoE's causal LM
        "num_experts": experts.num_experts,
        "num_experts_per_tok": experts.experts_per_token,
        "moe_intermediate_size": experts.width,
        "shared_expert_intermediate_size": experts.shared_width,
    }
    return fields


def _linear_sizes(file_name: str, get: Any, need: Any) -> dict[str, int]:
    """config.json's linear-attention sizes from the ``ssm.*`` metadata, checked."""
    key_heads, value_heads = need("ssm.group_count"), need("ssm.time_step_rank")
    inner = need("ssm.inner_size")
    if value_heads % key_heads:
        raise ValueError(
            f"{file_name}: ssm.time_step_rank {value_heads} (value heads) is not a multiple "
            f"of ssm.group_count {key_heads} (key heads)"
        )
    if inner % value_heads:
        raise ValueError(
            f"{file_name}: ssm.inner_size {inner} does not split into ssm.time_step_rank "
            f"{value_heads} value heads"
        )
    kernel = need("ssm.conv_kernel")
    if kernel < 2:
        raise ValueError(f"{file_name}: ssm.conv_kernel {kernel} leaves the conv no window")
    return {
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": need("ssm.state_size"),
        "linear_value_head_dim": inner // value_heads,
        "linear_conv_kernel_dim": kernel,
    }


def _layer_types(file_name: str, get: Any, layers: int, blocks: int) -> list[str]:
    """Which decoder layers are linear: ``attention.recurrent_layers`` (one flag per
    block, the MTP blocks' last), else every ``full_attention_interval``-th layer full."""
    flags = get("attention.recurrent_layers")
    if flags is None:
        interval = int(get("full_attention_interval", 4))
        if interval < 1:
            raise ValueError(f"{file_name}: full_attention_interval {interval} is not positive")
        flags = [(layer + 1) % interval != 0 for layer in range(layers)]
    flags = list(flags)
    if len(flags) not in (layers, blocks):
        raise ValueError(
            f"{file_name}: attention.recurrent_layers lists {len(flags)} layers, the file "
            f"has {blocks} blocks"
        )
    return ["linear_attention" if flag else "full_attention" for flag in flags[:layers]]


def _check_tensors(file_name: str, tensors: Tensors, config: dict, linear: dict) -> None:
    """Every layer holds its kind's tensors, in the sizes the metadata gives."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    for layer, kind in enumerate(config["layer_types"]):
        if kind == "full_attention":
            _need_all(file_name, tensors, layer, FULL_TENSORS)
            q_rows = 2 * config["num_attention_heads"] * head_dim
            _expect(file_name, tensors, f"blk.{layer}.attn_q.weight", (q_rows, hidden))
            continue
        fused_ba = [name for name in FUSED_BETA_ALPHA if f"blk.{layer}.{name}" in tensors]
        fused_qkvz = f"blk.{layer}.{FUSED_QKVZ}" in tensors
        _need_all(file_name, tensors, layer, LINEAR_TENSORS)
        _need_all(file_name, tensors, layer, () if fused_ba else SEPARATE_BETA_ALPHA)
        _need_all(file_name, tensors, layer, () if fused_qkvz else SEPARATE_QKVZ)
        shapes = _linear_shapes(hidden, linear, fused_qkvz, fused_ba[0] if fused_ba else None)
        for name, shape in shapes.items():
            _expect(file_name, tensors, f"blk.{layer}.{name}", shape)


def _linear_shapes(
    hidden: int, linear: dict, fused_qkvz: bool, fused_ba: str | None
) -> dict[str, tuple[int, ...]]:
    """A linear layer's tensors and their shapes (rows first), in the form it holds
    its projections."""
    key_dim = linear["linear_num_key_heads"] * linear["linear_key_head_dim"]
    heads = linear["linear_num_value_heads"]
    value_dim = heads * linear["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    if fused_qkvz:
        shapes = {FUSED_QKVZ: (conv_dim + value_dim, hidden)}
    else:
        shapes = {"attn_qkv.weight": (conv_dim, hidden), "attn_gate.weight": (value_dim, hidden)}
    if fused_ba:
        shapes[fused_ba] = (2 * heads, hidden)
    else:
        shapes.update({name: (heads, hidden) for name in SEPARATE_BETA_ALPHA})
    shapes.update(
        {
            "ssm_conv1d.weight": (conv_dim, linear["linear_conv_kernel_dim"]),
            "ssm_a": (heads,),
            "ssm_dt.bias": (heads,),
            "ssm_norm.weight": (linear["linear_value_head_dim"],),
            "ssm_out.weight": (hidden, value_dim),
        }
    )
    return shapes


def _need_all(file_name: str, tensors: Tensors, layer: int, names: tuple[str, ...]) -> None:
    missing = [f"blk.{layer}.{name}" for name in names if f"blk.{layer}.{name}" not in tensors]
    if missing:
        raise ValueError(f"{file_name}: layer {layer} lacks {', '.join(missing)}")


def _expect(file_name: str, tensors: Tensors, name: str, shape: tuple[int, ...]) -> None:
    found = tuple(tensors[name][1])
    if found != shape:
        raise ValueError(
            f"{file_name}: {name} has shape {list(found)} (rows first), not {list(shape)} as "
            "the file's ssm and attention sizes give"
        )
