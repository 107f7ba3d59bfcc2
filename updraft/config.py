"""Model and engine configuration.

``ModelConfig`` is read from a checkpoint's config.json and is everything the model code
needs; ``EngineConfig`` is how the engine is run (memory, batching, dtype).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from updraft.checkpoints import local_checkpoint
from updraft.demo import DEMO_EAGLE_DIR, DEMO_MODEL_DIR

if TYPE_CHECKING:
    import torch

LLAMA_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",  # fused qkv and gate/up in its checkpoints, LongRoPE
    "MistralForCausalLM",
)
# Llama-style attention with a softmax top-k mixture of experts in place of the MLP.
SPARSE_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
DEEPSEEK_ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
)
# Gemma 3's text models; of the multimodal one, its text tower (text_config).
GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
SUPPORTED_ARCHITECTURES = (
    LLAMA_ARCHITECTURES + SPARSE_MOE_ARCHITECTURES + GEMMA3_ARCHITECTURES + DEEPSEEK_ARCHITECTURES
)
# Where a config's sliding_window applies to every layer; Qwen's windows apply only with
# use_sliding_window (Qwen2's and Qwen3's from layer max_window_layers on, Qwen3-MoE's
# to every layer); Gemma 3's by layer_types.
EVERY_LAYER_WINDOWED = (
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen3MoeForCausalLM",
)
QWEN_WINDOWED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
FROM_MAX_WINDOW_LAYERS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
LAYER_TYPES = ("sliding_attention", "full_attention")
# What a published Gemma 3 text_config leaves out takes transformers' defaults.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
}
# By name: this module is what `updraft --help` reads, and must not import torch.
DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATIONS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 128)
HALF_DTYPES = ("float16", "bfloat16")
GRAPH_MODES = ("auto", "piecewise", "full")
DEVICE = re.compile(r"cpu|cuda(:\d+)?")
# The default of EngineConfig.compile_graphs where it is not given: a test suite that
# starts many engines sets it to 0 to skip inductor's compile time.
COMPILE_GRAPHS_ENV = "UPDRAFT_COMPILE_GRAPHS"
# The default of EngineConfig.capture_tokens: past 256 tokens a prefill step is its
# matrix products and a graph gains nothing (benchmarks/bench_prefill_steps.py). A test
# suite that starts many engines sets the variable to fewer sizes (comma-separated).
CAPTURE_TOKENS = (16, 32, 64, 128, 256)
CAPTURE_TOKENS_ENV = "UPDRAFT_CAPTURE_TOKENS"


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


@dataclass(frozen=True)
class WeightFormat:
    """How linear and expert weights are kept in memory: ``float32``, ``bfloat16`` or
    ``float16`` as they are, or quantized to ``int8`` (one scale per output row, or per
    ``group_size`` columns) or ``int4`` (per ``group_size`` columns, with a zero point per
    group where ``zero_point``)."""

    name: str
    group_size: int | None = None
    zero_point: bool = False

    @classmethod
    def of(cls, dtype: torch.dtype) -> WeightFormat:
        """Weights kept in ``dtype`` as they are."""
        return cls(str(dtype).removeprefix("torch."))

    @property
    def quantized(self) -> bool:
        return self.name in QUANTIZATIONS

    def __str__(self) -> str:
        if not self.quantized:
            return self.name
        group = f", groups of {self.group_size}" if self.group_size else ""
        return f"{self.name}{group}{', zero points' if self.zero_point else ''}"


PREQUANTIZED_METHODS = ("awq", "gptq", "compressed-tensors")
PREQUANTIZED_GROUP_SIZES = (32, 64, 128)
# What each method's tensors of one linear are called (the first names the linear).
PREQUANTIZED_TENSORS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"),
}


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """How a checkpoint's linears are quantized (``quantization_config``)."""

    method: str
    group_size: int | None  # None: one group per row (per-channel)
    symmetric: bool
    gptq_v1_zeros: bool = False  # GPTQ's original format stores each zero minus one

    @property
    def marker(self) -> str:
        """The tensor suffix that names a quantized linear."""
        return PREQUANTIZED_TENSORS[self.method][0]

    @property
    def suffixes(self) -> tuple[str, ...]:
        return PREQUANTIZED_TENSORS[self.method]

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> QuantizedCheckpoint:
        """The scheme of a ``quantization_config``; one that is not 4-bit weight-only in
        a layout read here is refused, by name."""
        method = str(raw.get("quant_method", "?")).lower()
        if method not in PREQUANTIZED_METHODS:
            raise ValueError(
                f"quantization_config: quant_method {method!r} is not supported "
                f"({', '.join(PREQUANTIZED_METHODS)} are, with 4-bit weights)"
            )
        if method == "compressed-tensors":
            return cls._compressed_tensors(raw)
        bits = raw.get("bits", raw.get("w_bit"))
        if bits != 4:
            raise ValueError(f"quantization_config: {method} with {bits}-bit weights (4 is read)")
        group = raw.get("group_size", raw.get("q_group_size"))
        if method == "awq":
            version = str(raw.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(
                    f"quantization_config: AWQ version {version!r} is not supported (gemm is)"
                )
            return cls("awq", _group(group), symmetric=not raw.get("zero_point", True))
        if raw.get("desc_act"):
            raise ValueError(
                "quantization_config: GPTQ desc_act (act-order, a g_idx that is not in "
                "order) is not supported; quantize with desc_act false"
            )
        fmt = str(raw.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(
                f"quantization_config: GPTQ checkpoint_format {fmt!r} is not supported "
                "(gptq and gptq_v2 are)"
            )
        if raw.get("lm_head"):
            raise ValueError("quantization_config: a GPTQ-quantized lm_head is not supported")
        return cls(
            "gptq", _group(group), symmetric=bool(raw.get("sym", True)), gptq_v1_zeros=fmt == "gptq"
        )

    @classmethod
    def _compressed_tensors(cls, raw: dict[str, Any]) -> QuantizedCheckpoint:
        fmt = raw.get("format")
        if fmt != "pack-quantized":
            raise ValueError(
                f"quantization_config: compressed-tensors format {fmt!r} is not supported "
                "(pack-quantized, W4A16, is)"
            )
        groups = list((raw.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(
                f"quantization_config: {len(groups)} compressed-tensors config_groups "
                "(one is supported)"
            )
        weights = groups[0].get("weights") or {}
        if groups[0].get("input_activations"):
            raise ValueError(
                "quantization_config: quantized activations (compressed-tensors "
                "input_activations) are not supported; W4A16 is"
            )
        if weights.get("num_bits") != 4 or weights.get("type", "int") != "int":
            raise ValueError(
                f"quantization_config: compressed-tensors weights of {weights.get('num_bits')} "
                f"bits, type {weights.get('type')!r} (4-bit int is read)"
            )
        if weights.get("actorder"):
            raise ValueError(
                "quantization_config: compressed-tensors actorder (weight_g_idx) is not supported"
            )
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel"):
            raise ValueError(
                f"quantization_config: compressed-tensors strategy {strategy!r} "
                "(group and channel are read)"
            )
        group = _group(weights.get("group_size")) if strategy == "group" else None
        return cls("compressed-tensors", group, symmetric=bool(weights.get("symmetric", True)))


def _group(value: Any) -> int | None:
    if value in (None, -1):
        return None
    if value not in PREQUANTIZED_GROUP_SIZES:
        raise ValueError(
            f"quantization_config: group_size {value!r} is not supported "
            f"({', '.join(map(str, PREQUANTIZED_GROUP_SIZES))} or per-channel are)"
        )
    return value


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3 | yarn | longrope
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN: the rotation counts that bound the blend of interpolated and original
    # frequencies, and the cos/sin scale (attention_factor, else derived from mscale).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # LongRoPE (Phi-3): per-frequency divisors for a sequence within the original
    # context, and for one past it.
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek): queries through an optional low-rank
    ``q_lora_rank``; keys and values from one compressed latent of ``kv_lora_rank``
    values per token plus a shared rotary key of ``qk_rope_head_dim``."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary pairs are adjacent columns (x0, x1), (x2, x3), ...


@dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts: routed experts chosen by a group-limited router, and shared
    experts every token passes through. DeepSeek-V3's router scores with a sigmoid (plus
    a bias for choosing) and ranks groups by their two best scores; V2's with a softmax,
    ranking groups by their best. Qwen3-MoE and Mixtral are a softmax over one group,
    with no shared experts."""

    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    n_shared_experts: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    scoring: str = "sigmoid"  # sigmoid (V3, with e_score_correction_bias) | softmax (V2)
    group_score: str = "top2_sum"  # top2_sum (V3) | max (V2)


@dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek sparse attention's lightning indexer: each query attends only to the
    ``topk`` context tokens its ``n_heads`` ReLU scores rank highest."""

    n_heads: int
    head_dim: int
    topk: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    checkpoint_dtype: str  # one of DTYPES
    eos_token_ids: tuple[int, ...] = ()
    # The leading dimensions of each head that RoPE turns (Phi-4-mini: 3/4 of them).
    partial_rotary_factor: float = 1.0
    # DeepSeek: latent attention, experts from layer ``first_k_dense_replace`` on, and
    # (V3.2) the sparse-attention indexer.
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    first_k_dense_replace: int = 0
    # Qwen3-MoE: layers that keep a dense MLP (mlp_only_layers, decoder_sparse_step).
    dense_layers: frozenset[int] = frozenset()
    indexer: IndexerConfig | None = None
    # Multi-token prediction layers stored after the decoder layers (DeepSeek's
    # num_nextn_predict_layers): the loader skips them.
    mtp_layers: int = 0
    # Per decoder layer, its sliding window (a query at position p sees positions
    # p - window + 1 .. p), or None for full attention; empty: no layer has one.
    layer_windows: tuple[int | None, ...] = ()
    # Gemma 3: the MLP's activation, norms that scale by (1 + weight), the attention
    # scale (query_pre_attn_scalar ** -0.5), the sliding layers' own RoPE, embeddings
    # scaled by sqrt(hidden_size), and a tanh cap on the logits.
    hidden_act: str = "silu"  # silu | gelu_pytorch_tanh
    norm_offset: float = 0.0
    attention_scale: float | None = None
    local_rope: RopeConfig | None = None
    embedding_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    # Linears quantized to 4 bits before they reached here (AWQ, GPTQ, compressed-tensors).
    quantized: QuantizedCheckpoint | None = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def window(self, layer: int) -> int | None:
        """Decoder layer ``layer``'s sliding window, or None (full attention)."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def widest_window(self) -> int | None:
        """The widest window when every layer has one (how far back any layer reads),
        else None: some layer reads the whole context."""
        windows = [self.window(layer) for layer in range(self.num_layers)]
        return None if None in windows else max(windows)

    def has_experts(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` routes to experts rather than one MLP."""
        return (
            self.moe is not None
            and layer >= self.first_k_dense_replace
            and layer not in self.dense_layers
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model directory not found: {model_dir}")
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from error
        return cls.from_dict(raw, eos_token_ids=_eos_token_ids(model_dir, raw))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        architectures = raw.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            raise ValueError(
                f"unsupported architecture {architectures or '(none given)'}; "
                f"updraft supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        quantized = None
        if raw.get("quantization_config"):
            quantized = QuantizedCheckpoint.from_config(raw["quantization_config"])
            if architecture not in LLAMA_ARCHITECTURES + GEMMA3_ARCHITECTURES:
                raise ValueError(
                    f"a {quantized.method} checkpoint of {architecture} is not supported: "
                    "pre-quantized experts and latent attention are not read yet"
                )
        family = {}
        if architecture in GEMMA3_ARCHITECTURES:
            raw, family = _gemma3_parts(raw, architecture)
        elif raw.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"config.json: hidden_act {raw['hidden_act']!r} is not supported (silu is)"
            )
        num_heads = _positive_int(raw, "num_attention_heads")
        hidden_size = _positive_int(raw, "hidden_size")
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        if architecture in DEEPSEEK_ARCHITECTURES:
            family = _deepseek_parts(raw, architecture)
            head_dim = family["mla"].qk_rope_head_dim  # the rotary part is what RoPE turns
        elif architecture in SPARSE_MOE_ARCHITECTURES:
            family = _sparse_moe_parts(raw, architecture)
        return cls(
            architecture=architecture,
            vocab_size=_positive_int(raw, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_positive_int(raw, "intermediate_size"),
            num_layers=_positive_int(raw, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope=_rope_config(raw),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases; Llama has them only when asked.
            attention_bias=architecture == "Qwen2ForCausalLM" or raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            qk_norm=architecture
            in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", *GEMMA3_ARCHITECTURES),
            checkpoint_dtype=_dtype_name(raw.get("torch_dtype") or raw.get("dtype")),
            eos_token_ids=eos_token_ids,
            partial_rotary_factor=float(
                (raw.get("rope_parameters") or {}).get("partial_rotary_factor")
                or raw.get("partial_rotary_factor")
                or 1.0
            ),
            layer_windows=_layer_windows(raw, architecture),
            quantized=quantized,
            **family,
        )


def _layer_windows(raw: dict[str, Any], architecture: str) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers applies the config: every layer's
    for Mistral, Mixtral, Phi-3 and (with use_sliding_window) Qwen3-MoE; for Qwen2 and
    Qwen3, with use_sliding_window, from max_window_layers on; layer_types where the
    config lists them (Gemma 3, and the configs transformers 5 writes), else Gemma 3's
    sliding_window_pattern."""
    window = raw.get("sliding_window")
    if architecture in QWEN_WINDOWED and not raw.get("use_sliding_window"):
        window = None
    windowed = EVERY_LAYER_WINDOWED + FROM_MAX_WINDOW_LAYERS + GEMMA3_ARCHITECTURES
    if window is None or architecture not in windowed:
        return ()
    window = _positive_int(raw, "sliding_window")
    layers = _positive_int(raw, "num_hidden_layers")
    # Mistral, Mixtral, Phi-3 and Qwen3-MoE window every layer, whatever else is listed.
    kinds = None if architecture in EVERY_LAYER_WINDOWED else raw.get("layer_types")
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {*LAYER_TYPES}:
            raise ValueError(
                f"config.json: layer_types must list one of {', '.join(LAYER_TYPES)} for each "
                f"of the {layers} layers, got {kinds!r}"
            )
        sliding = [kind == "sliding_attention" for kind in kinds]
    elif architecture in FROM_MAX_WINDOW_LAYERS:
        first = raw.get("max_window_layers", 28)  # transformers' default
        sliding = [layer >= first for layer in range(layers)]
    elif architecture in GEMMA3_ARCHITECTURES:
        pattern = _positive_int(raw, "sliding_window_pattern")
        sliding = [bool((layer + 1) % pattern) for layer in range(layers)]
    else:
        sliding = [True] * layers
    return tuple(window if slides else None for slides in sliding)


def _gemma3_parts(raw: dict[str, Any], architecture: str) -> tuple[dict[str, Any], dict]:
    """Gemma 3's text config (with transformers' defaults where a published config is
    silent) and what sets its layers apart from Llama's. Of the multimodal model only
    the text tower is served: its config is ``text_config``."""
    given = raw
    if architecture == "Gemma3ForConditionalGeneration":
        given = raw.get("text_config")
        if not isinstance(given, dict):
            raise ValueError("config.json: Gemma3ForConditionalGeneration lacks its text_config")
        top = {"torch_dtype": raw.get("torch_dtype") or raw.get("dtype")}
        top["tie_word_embeddings"] = raw.get("tie_word_embeddings", True)
        given = {**top, **given}
    if "sliding_window" in given and given["sliding_window"] is None:
        raise ValueError("config.json: Gemma 3 without a sliding_window is not supported")
    text = {**GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    activation = text.get("hidden_activation") or text.get("hidden_act")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(
            f"config.json: Gemma 3 hidden_activation {activation!r} is not supported "
            "(gelu_pytorch_tanh is)"
        )
    if text.get("attn_logit_softcapping") is not None:
        raise ValueError("config.json: attention logit soft-capping is not supported")
    if text.get("use_bidirectional_attention"):
        raise ValueError("config.json: Gemma 3 bidirectional attention is not supported")
    # transformers 5 nests each layer kind's RoPE in rope_parameters; published configs
    # give the global one as rope_theta (and rope_scaling) and the local base apart.
    nested = text.get("rope_parameters") or {}
    if not set(nested) <= {*LAYER_TYPES}:
        nested = {"full_attention": nested}
    full = {"rope_theta": text["rope_theta"], **(text.get("rope_scaling") or {})}
    full.update(nested.get("full_attention") or {})
    local = {"rope_theta": text["rope_local_base_freq"]}
    local.update(nested.get("sliding_attention") or {})
    text = {**text, "rope_parameters": full, "rope_scaling": None}
    family = {
        "hidden_act": "gelu_pytorch_tanh",
        "norm_offset": 1.0,
        "attention_scale": float(text["query_pre_attn_scalar"]) ** -0.5,
        "local_rope": _rope_config({**text, "rope_parameters": local}),
        "embedding_multiplier": float(text["hidden_size"]) ** 0.5,
        # transformers caps the text model's logits but not the multimodal model's
        # (published Gemma 3 configs set no cap either way).
        "final_logit_softcapping": None
        if architecture == "Gemma3ForConditionalGeneration"
        else text.get("final_logit_softcapping"),
    }
    return text, family


def _sparse_moe_parts(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Qwen3-MoE and Mixtral: softmax over every expert, the top k kept (renormalised
    where norm_topk_prob says so; Mixtral always), no shared experts."""
    layers = _positive_int(raw, "num_hidden_layers")
    # Published Qwen3-MoE configs say num_experts; transformers 5 writes num_local_experts.
    key = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
    num_experts = _positive_int(raw, key)
    if architecture == "MixtralForCausalLM":
        inter, norm, dense = _positive_int(raw, "intermediate_size"), True, frozenset()
    else:
        inter = _positive_int(raw, "moe_intermediate_size")
        norm = bool(raw.get("norm_topk_prob", False))
        step = raw.get("decoder_sparse_step") or 1
        only_mlp = set(raw.get("mlp_only_layers") or ())
        dense = frozenset(i for i in range(layers) if i in only_mlp or (i + 1) % step)
    moe = MoEConfig(
        hidden_size=_positive_int(raw, "hidden_size"),
        moe_intermediate_size=inter,
        num_experts=num_experts,
        num_experts_per_tok=_positive_int(raw, "num_experts_per_tok"),
        n_group=1,
        topk_group=1,
        n_shared_experts=0,
        routed_scaling_factor=1.0,
        norm_topk_prob=norm,
        scoring="softmax",
        group_score="max",
    )
    if moe.num_experts_per_tok > num_experts:
        raise ValueError(
            f"config.json: num_experts_per_tok {moe.num_experts_per_tok} is more than the "
            f"{num_experts} experts"
        )
    return {"moe": moe, "dense_layers": dense}


def _deepseek_parts(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    if raw.get("attention_bias"):
        raise ValueError("config.json: DeepSeek attention with attention_bias is not supported")
    q_lora_rank = raw.get("q_lora_rank")
    if q_lora_rank is not None:
        q_lora_rank = _positive_int(raw, "q_lora_rank")
    mla = MLAConfig(
        q_lora_rank=q_lora_rank,
        kv_lora_rank=_positive_int(raw, "kv_lora_rank"),
        qk_nope_head_dim=_positive_int(raw, "qk_nope_head_dim"),
        qk_rope_head_dim=_positive_int(raw, "qk_rope_head_dim"),
        v_head_dim=_positive_int(raw, "v_head_dim"),
        # V2 and V3.2 always interleave; V3 says so in its config (default true).
        rope_interleave=architecture != "DeepseekV3ForCausalLM"
        or bool(raw.get("rope_interleave", True)),
    )
    if mla.qk_rope_head_dim % 2:
        raise ValueError(f"config.json: qk_rope_head_dim must be even, got {mla.qk_rope_head_dim}")
    num_experts = _positive_int(raw, "n_routed_experts")
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
        hidden_size=_positive_int(raw, "hidden_size"),
        moe_intermediate_size=_positive_int(raw, "moe_intermediate_size"),
        num_experts=num_experts,
        num_experts_per_tok=_positive_int(raw, "num_experts_per_tok"),
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
    indexer = None
    if architecture == "DeepseekV32ForCausalLM":
        if q_lora_rank is None:
            raise ValueError(
                "config.json: DeepSeek-V3.2 needs q_lora_rank (its indexer reads the query latent)"
            )
        indexer = IndexerConfig(
            n_heads=_positive_int(raw, "index_n_heads"),
            head_dim=_positive_int(raw, "index_head_dim"),
            topk=_positive_int(raw, "index_topk"),
        )
        if indexer.head_dim < mla.qk_rope_head_dim:
            raise ValueError("config.json: index_head_dim must be at least qk_rope_head_dim")
    return {
        "mla": mla,
        "moe": moe,
        "first_k_dense_replace": int(raw.get("first_k_dense_replace") or 0),
        "indexer": indexer,
        "mtp_layers": int(raw.get("num_nextn_predict_layers") or 0),
    }


def _positive_int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if value is None:
        raise ValueError(f"config.json lacks {key!r}, which the model needs")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json: {key} must be a positive int, got {value!r}")
    return value


def _dtype_name(value: Any) -> str:
    name = str(value or "float32").removeprefix("torch.")
    return name if name in DTYPES else "float32"


ROPE_KINDS = ("default", "linear", "llama3", "yarn", "longrope")


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
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
        **optional,
        **factors,
    )


def _eos_token_ids(model_dir: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present (it is what generate uses), else
    from config.json."""
    value = raw.get("eos_token_id")
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        value = json.loads(generation_config.read_text()).get("eos_token_id", value)
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


@dataclass(frozen=True)
class ParallelSizes:
    """How many ranks split a model, each way (parallel/topology.py)."""

    tensor: int = 1
    prefill_context: int = 1
    decode_context: int = 1

    @property
    def world(self) -> int:
        return self.tensor * self.prefill_context

    def check(self) -> None:
        for name, size in vars(self).items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{name}_parallel_size must be an int >= 1, got {size!r}")
        if self.tensor % self.decode_context:
            raise ValueError(
                f"decode_context_parallel_size {self.decode_context} must divide "
                f"tensor_parallel_size {self.tensor}: its ranks are tensor-parallel ranks "
                "that keep the same KV heads and split the context"
            )


def setting(default: Any, help: str, **cli: Any) -> Any:
    """An ``EngineConfig`` field with its command-line help (``cli`` adds argparse
    options such as ``choices``); the CLI makes one flag per field from these."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineConfig:
    """How the engine runs. Defaults suit the CPU; a GPU wants a larger KV budget.

    Every field is also an ``updraft`` flag (``block_size`` is ``--block-size``), with
    its default, type and help taken from here."""

    model: str = field(metadata={"help": "local Hugging Face checkpoint directory, or a GGUF file"})
    dtype: str = setting(
        "auto",
        "compute dtype; auto is float32 on the CPU with the weights kept in the "
        "checkpoint's dtype (bfloat16 and float16 stay 2 bytes), and the checkpoint's dtype "
        "on a GPU",
        choices=["auto", *DTYPES],
    )
    device: str = setting("cpu", "cpu, cuda or cuda:N")
    quantization: str | None = setting(
        None,
        "weight-only quantization at load, of linear layers and routed experts (CPU only, "
        "float32 activations): int8 (a scale per output row, about a quarter of float32's "
        "bytes) or int4 (a scale and a zero point per --quantization-group-size columns)",
        choices=QUANTIZATIONS,
    )
    quantization_group_size: int = setting(
        128,
        "int4: weight columns per scale and zero point",
        choices=INT4_GROUP_SIZES,
    )
    activations: str = setting(
        "float32",
        "how a GGUF file's quantized linears take a decode step's activations: float32 "
        "(exact: float32 x times the weights' own values) or int8 (x rounded to int8 "
        "per 32 values, as llama.cpp computes, against Q4_0, Q8_0, Q4_K "
        "and Q6_K rows regrouped eight at a time; on a CPU with AVX2, 1.5-2.5x faster "
        "batch-1 decoding, at about a percent of error on each product)",
        choices=["float32", "int8"],
    )
    adaptive_threads: bool = setting(
        True,
        "on the CPU, leave other processes the cores they keep busy (kernels that wait for "
        "a thread sharing a busy core run several times slower); --no-adaptive-threads "
        "keeps every core",
    )
    keep_freed_memory: bool = setting(
        True,
        "on the CPU, keep the memory a step's temporaries free for the next step (glibc "
        "malloc's mmap and trim thresholds at 1 GiB) instead of returning it to the OS, "
        "which then faults it in again page by page (about a sixth of an eager prefill's "
        "time on two cores); --no-keep-freed-memory returns it",
    )
    seed: int = setting(0, "seed of the sampling of requests that have no seed of their own")
    overlap_grammar_masks: bool | None = setting(
        None,
        "compute the token masks of requests with structured outputs in a thread while "
        "the step's forward runs, rather than after it (default: on a GPU, and on a CPU "
        "with a core the forward's threads leave free: a mask thread on a core the "
        "forward uses slows every step down more than the masks cost)",
    )
    block_size: int = setting(16, "tokens per KV cache block")
    kv_cache_memory_gib: float = setting(1.0, "KV cache budget in GiB")
    num_kv_blocks: int | None = setting(None, "KV cache blocks; overrides kv_cache_memory_gib")
    max_num_seqs: int = setting(64, "most requests running at once")
    max_num_batched_tokens: int = setting(
        1024, "most tokens per step; longer prompts are prefilled in chunks"
    )
    max_model_len: int | None = setting(
        None, "context length (default: the model's max_position_embeddings)"
    )
    enable_prefix_caching: bool = setting(True, "reuse the KV of prompt blocks seen before")
    enforce_eager: bool = setting(
        False,
        # Captured steps remove CUDA's launch overhead; on the CPU their compiled runs
        # fuse the small ops between matrix products (benchmarks/RESULTS.md).
        "run every step eagerly instead of replaying captured decode and verify steps",
    )
    compile_graphs: bool | None = setting(
        None,
        "on the CPU, compile each captured step's runs of ops between attention calls into "
        "fused kernels with inductor (seconds per capture size at the first start, cached "
        "on disk after); --no-compile-graphs replays them op by op (default: on, or "
        f"${COMPILE_GRAPHS_ENV} when set to 0 or 1)",
    )
    graph_mode: str = setting(
        "auto",
        "piecewise: attention, whose shapes change every step, runs between captured "
        "segments with that step's shapes; full: decode and verify graphs hold attention "
        "too, shaped by the bucket over every block a request may have (one CUDA graph "
        "per step, but attention over max_model_len wherever it gathers); auto: full where "
        "attention reads the cache in place (float32 on the CPU, queries of up to 8 "
        "tokens, no sparse-attention indexer), else piecewise",
        choices=["auto", "piecewise", "full"],
    )
    capture_sizes: tuple[int, ...] = setting(
        (1, 2, 4, 8, 16, 32, 64), "batch sizes of captured steps, comma-separated"
    )
    capture_tokens: tuple[int, ...] | None = setting(
        None,
        "token counts of captured mixed steps (prefill chunks, alone or beside decodes), "
        "comma-separated: such a step replays the smallest at least its size, its matrix "
        "products over its own tokens only; larger ones run eagerly (default: "
        f"{','.join(map(str, CAPTURE_TOKENS))}, or ${CAPTURE_TOKENS_ENV} when set)",
    )
    sanitize: bool = setting(
        False,
        "check every graph replay against eager on a copy of the KV cache (copies the "
        "whole cache each step: use a small one)",
    )
    speculative_method: str | None = setting(
        None,
        "draft (a draft model; implied by --speculative-model), ngram (prompt lookup), mtp "
        "(a DeepSeek checkpoint's multi-token prediction layer), eagle (an EAGLE-1 head "
        "reading the target's hidden states), or a registered proposer",
    )
    speculative_model: str | None = setting(
        None,
        "draft model checkpoint directory or GGUF file, with the target's tokenizer; or, with "
        "--speculative-method eagle, the EAGLE head's directory",
    )
    num_speculative_tokens: int = setting(3, "draft tokens verified per step")
    speculative_enforce_eager: bool | None = setting(
        None, "run the draft model's steps eagerly (default: as the target)"
    )
    draft_tensor_parallel_size: int = setting(
        1,
        "ranks the draft model splits over: 1 (whole on rank 0) or --tensor-parallel-size "
        "(split like the target on every tensor rank, replicated across prefill-context "
        "ranks)",
    )
    tensor_parallel_size: int = setting(
        1,
        "ranks that split every layer's heads and MLP rows (worker processes this engine "
        "starts, gloo on the CPU); the Llama family and DeepSeek",
    )
    prefill_context_parallel_size: int = setting(
        1,
        "ranks that split each long prefill's tokens, each with a whole tensor-parallel "
        "group (ranks in all: tensor x prefill context)",
    )
    decode_context_parallel_size: int = setting(
        1,
        "tensor-parallel ranks that keep the same KV heads and split every context "
        "between them, position by position (divides --tensor-parallel-size)",
    )
    probe: str | None = setting(
        None,
        "a directory where every rank records each step it runs, each graph replay's "
        "inputs and its KV caches at close (runner/probe.py; for tests and debugging)",
    )

    def __post_init__(self) -> None:
        self.model = local_checkpoint(str(self.model))
        if self.speculative_model is not None:
            self.speculative_model = local_checkpoint(str(self.speculative_model))
        if not DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {self.dtype!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.quantization_group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                "quantization_group_size must be one of "
                f"{', '.join(map(str, INT4_GROUP_SIZES))}, got {self.quantization_group_size!r}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(
                f"graph_mode must be one of {', '.join(GRAPH_MODES)}, got {self.graph_mode!r}"
            )
        if not self.capture_sizes or min(self.capture_sizes) < 1:
            raise ValueError(f"capture_sizes must be sizes >= 1, got {self.capture_sizes}")
        if self.mixed_capture_tokens and min(self.mixed_capture_tokens) < 1:
            raise ValueError(f"capture_tokens must be sizes >= 1, got {self.mixed_capture_tokens}")
        if self.speculative_model is not None and self.speculative_method is None:
            self.speculative_method = "draft"
        if self.speculative_method == "eagle" and self.speculative_model is None:
            if Path(self.model).resolve() != DEMO_MODEL_DIR:
                raise ValueError(
                    "speculative_method 'eagle' needs speculative_model (an EAGLE head "
                    "directory); only the demo model has a head shipped with updraft"
                )
            self.speculative_model = str(DEMO_EAGLE_DIR)
        if self.speculative_method == "draft" and self.speculative_model is None:
            raise ValueError(
                "speculative_method 'draft' needs speculative_model (a draft checkpoint directory)"
            )
        if self.speculative_method in ("ngram", "mtp") and self.speculative_model is not None:
            raise ValueError(
                f"speculative_method {self.speculative_method!r} takes no speculative_model, "
                f"got {self.speculative_model!r}"
            )
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be an int >= 1, got {self.num_speculative_tokens!r}"
            )
        self.parallel_sizes.check()
        self._check_draft_tensor_parallel()
        if self.parallel_sizes.world > 1 and self.sanitize:
            raise ValueError("sanitize is not supported over several ranks")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def _check_draft_tensor_parallel(self) -> None:
        if self.draft_tensor_parallel_size not in (1, self.tensor_parallel_size):
            raise ValueError(
                f"draft_tensor_parallel_size must be 1 or tensor_parallel_size "
                f"({self.tensor_parallel_size}), got {self.draft_tensor_parallel_size!r}"
            )
        if self.draft_tensor_parallel_size > 1 and self.speculative_method != "draft":
            raise ValueError(
                "draft_tensor_parallel_size is the draft model's (speculative_method "
                f"'draft'), got it with {self.speculative_method!r}"
            )

    @property
    def parallel_sizes(self) -> ParallelSizes:
        return ParallelSizes(
            self.tensor_parallel_size,
            self.prefill_context_parallel_size,
            self.decode_context_parallel_size,
        )

    @property
    def positions_per_block(self) -> int:
        """Positions of a sequence per KV block, as the scheduler counts them: each of
        the C ranks of a decode-context group keeps ``block_size`` of them, so a block
        is ``block_size`` slots of each rank's cache."""
        return self.block_size * self.decode_context_parallel_size

    @property
    def use_graphs(self) -> bool:
        return not self.enforce_eager

    @property
    def mixed_capture_tokens(self) -> tuple[int, ...]:
        """``capture_tokens`` as given, else from the environment, else the default."""
        if self.capture_tokens is not None:
            return self.capture_tokens
        text = os.environ.get(CAPTURE_TOKENS_ENV)
        if text is None:
            return CAPTURE_TOKENS
        try:
            return tuple(int(size) for size in text.split(",") if size.strip())
        except ValueError:
            raise ValueError(
                f"${CAPTURE_TOKENS_ENV} must be comma-separated sizes, got {text!r}"
            ) from None

    @property
    def compiles_graphs(self) -> bool:
        if self.compile_graphs is not None:
            return self.compile_graphs
        return os.environ.get(COMPILE_GRAPHS_ENV, "1") != "0"

    def start_up_steps(self) -> str:
        """What building an engine from this config does, for a progress line: loading
        takes seconds, compiling graphs up to a minute at the first start."""
        what = "loading the model"
        if self.use_graphs:
            what += " and capturing graphs"
            if self.compiles_graphs and self.device == "cpu":
                what += " (compiling them: up to a minute at the first start, seconds after)"
        return what

    def compute_dtype(self, model_config: ModelConfig) -> torch.dtype:
        if self.dtype != "auto":
            return torch_dtype(self.dtype)
        # Half-precision matmuls are slow on most CPUs: compute in float32 there.
        if self.device == "cpu":
            return torch_dtype("float32")
        return torch_dtype(model_config.checkpoint_dtype)

    def weight_format(self, model_config: ModelConfig) -> WeightFormat:
        """How the linear and expert weights are kept: quantized as asked; else, with
        ``dtype`` auto on the CPU, in a half-precision checkpoint's own dtype (the
        kernels widen them in registers); else in the compute dtype."""
        compute = self.compute_dtype(model_config)
        prequantized = model_config.quantized
        if prequantized is not None and (
            self.quantization is not None or self.device != "cpu" or str(compute) != "torch.float32"
        ):
            raise ValueError(
                f"a {prequantized.method} checkpoint runs on the CPU in float32 with its "
                "own 4-bit weights (no --quantization, --dtype auto or float32)"
            )
        if self.quantization is not None:
            if self.device != "cpu" or str(compute) != "torch.float32":
                raise ValueError(
                    f"quantization {self.quantization!r} runs on the CPU in float32, not on "
                    f"{self.device} in {str(compute).removeprefix('torch.')}"
                )
            if self.quantization == "int8":
                return WeightFormat("int8")
            return WeightFormat("int4", self.quantization_group_size, zero_point=True)
        if (
            self.device == "cpu"
            and self.dtype == "auto"
            and model_config.checkpoint_dtype in HALF_DTYPES
        ):
            return WeightFormat(model_config.checkpoint_dtype)
        return WeightFormat.of(compute)
