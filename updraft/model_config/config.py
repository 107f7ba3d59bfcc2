"""``ModelConfig``: everything the model code needs of a checkpoint, read from its
config.json by the parser its architecture's registry row names."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from updraft.model_config import registry
from updraft.model_config.fields import read_eos_token_ids
from updraft.model_config.parts import (
    IndexerConfig,
    LinearAttentionConfig,
    MLAConfig,
    MoEConfig,
    RopeConfig,
)
from updraft.model_config.weights_held import check_against_weights, weights_held
from updraft.weights import QuantizedCheckpoint


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
    checkpoint_dtype: str  # one of weights.DTYPES
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
    # Qwen3.5, Qwen3-Next: the decoder layers that are Gated DeltaNet (linear
    # attention) layers, which keep a recurrent state per request instead of KV, and
    # their sizes; the other layers' attention output is gated by sigmoid(q_proj's
    # second half) (``attention_output_gate``).
    linear_attention: LinearAttentionConfig | None = None
    linear_layers: frozenset[int] = frozenset()
    attention_output_gate: bool = False
    # gpt-oss: a learned logit per query head in each attention softmax's denominator.
    attention_sinks: bool = False
    # Gemma 4: full-attention layers with a head size and KV heads of their own
    # (global_head_dim, num_global_key_value_heads), whose values are their keys
    # (attention_k_eq_v); the last ``num_kv_shared_layers`` layers read the KV of the
    # last writing layer of their kind and write none (their MLPs twice as wide where
    # ``double_wide_mlp``); per-layer inputs of ``per_layer_input_size`` values per
    # layer, from a table of ``per_layer_vocab_size`` rows.
    full_head_dim: int | None = None
    full_kv_heads: int | None = None
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
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

    def layer_type(self, layer: int) -> str:
        """``sliding_attention`` or ``full_attention``, as transformers names them."""
        return "full_attention" if self.window(layer) is None else "sliding_attention"

    def layer_head_dim(self, layer: int) -> int:
        """Decoder layer ``layer``'s attention head size."""
        full = self.full_head_dim is not None and self.window(layer) is None
        return self.full_head_dim if full else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        """Decoder layer ``layer``'s KV heads."""
        full = self.full_kv_heads is not None and self.window(layer) is None
        return self.full_kv_heads if full else self.num_kv_heads

    def kv_source(self, layer: int) -> int:
        """The layer whose KV decoder layer ``layer`` attends over: its own, or for a
        KV-shared layer the last writing layer of its kind."""
        first_shared = self.num_layers - self.num_kv_shared_layers
        if layer < first_shared:
            return layer
        kind = self.layer_type(layer)
        return max(i for i in range(first_shared) if self.layer_type(i) == kind)

    def kv_store_layers(self) -> dict[str, int]:
        """The last writing layer of each kind, by kind: the KV an assistant drafter
        reads (transformers' "store" layers)."""
        first_shared = self.num_layers - self.num_kv_shared_layers
        return {self.layer_type(i): i for i in range(first_shared) if not self.is_linear(i)}

    def is_linear(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is a linear-attention layer (no KV cache)."""
        return layer in self.linear_layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend over the paged cache (KV-shared ones included)."""
        return tuple(i for i in range(self.num_layers) if i not in self.linear_layers)

    @property
    def kv_writing_layers(self) -> tuple[int, ...]:
        """The attention layers that keep KV of their own in the paged cache."""
        return tuple(i for i in self.attention_layers if self.kv_source(i) == i)

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
        if not isinstance(raw, dict):
            raise ValueError(f"{path} is not a JSON object")
        files = sorted(model_dir.glob("*.safetensors"))
        if files:  # sizes checked before anything is built from them
            held = weights_held(files)
            for sizes in (raw, raw.get("text_config")):
                if isinstance(sizes, dict):
                    check_against_weights(path, sizes, held)
        return cls.from_dict(raw, eos_token_ids=read_eos_token_ids(model_dir, raw))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        row = registry.find(raw.get("architectures") or [])
        quantized = None
        if raw.get("quantization_config"):
            quantized = QuantizedCheckpoint.from_config(raw["quantization_config"])
            mxfp4 = quantized.method == "mxfp4"
            if not (row.mxfp4_experts if mxfp4 else row.prequantized):
                why = (
                    "MXFP4 is read as gpt-oss's experts only"
                    if mxfp4
                    else "pre-quantized experts and latent attention are not read yet"
                )
                raise ValueError(
                    f"a {quantized.method} checkpoint of {row.name} is not supported: {why}"
                )
        parsed = row.parse(raw, row.name)
        return cls(
            architecture=row.name, eos_token_ids=eos_token_ids, quantized=quantized, **parsed
        )
