"""The parts of a model's config that only some families have: RoPE scaling, latent
attention, experts, DeepSeek's sparse-attention indexer and linear attention."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3 | yarn | longrope | proportional
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
    # llama.cpp's per-frequency divisors (a GGUF file's ``rope_freqs``, how its files
    # hold Llama 3.1's scaling): each inverse frequency is divided by its factor before
    # the kind's own scaling, as llama.cpp's RoPE does.
    frequency_factors: tuple[float, ...] | None = None
    # Proportional RoPE (Gemma 4's full layers): only the first ``proportion`` of the
    # head's frequencies turn, at the exponents of the whole head; the rest stay still.
    proportion: float = 1.0


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
    with no shared experts; Qwen2-MoE adds one shared expert of its own width whose
    output each token scales by sigmoid(shared_expert_gate(x))."""

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
    # The shared experts' rows when not n_shared_experts * moe_intermediate_size.
    shared_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    activation: str = "silu"  # the experts' gate: silu | gelu_pytorch_tanh (Gemma 4)
    # gpt-oss's experts: the clamped SwiGLU's sigmoid gain and clamp (None: plain SiLU).
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None

    @property
    def shared_size(self) -> int:
        """Rows of the MLP that stands for every shared expert (0: none)."""
        if self.shared_intermediate_size is not None:
            return self.shared_intermediate_size
        return self.moe_intermediate_size * self.n_shared_experts


@dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek sparse attention's lightning indexer: each query attends only to the
    ``topk`` context tokens its ``n_heads`` ReLU scores rank highest."""

    n_heads: int
    head_dim: int
    topk: int


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers (Qwen3.5, Qwen3-Next): no KV per token, but per request a
    causal-conv window over the last ``conv_kernel - 1`` tokens' q/k/v channels and a
    recurrent state of ``num_value_heads x key_head_dim x value_head_dim`` values. Each
    key head serves ``num_value_heads / num_key_heads`` value heads."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """The channels the causal conv runs over: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def state_width(self) -> int:
        """Values one request's state row holds for one layer: the conv window, then
        the recurrent state."""
        return (
            self.conv_dim * (self.conv_kernel - 1)
            + self.num_value_heads * self.key_head_dim * self.value_head_dim
        )
