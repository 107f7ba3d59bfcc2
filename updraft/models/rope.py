"""Rotary position embeddings (the rotate-half layout Hugging Face Llama checkpoints use)."""

from __future__ import annotations

import math

import torch

from updraft.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, long: bool = False) -> torch.Tensor:
    """``long``: LongRoPE's frequencies for a sequence past its original context."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.frequency_factors is not None:
        if len(rope.frequency_factors) != head_dim // 2:
            raise ValueError(
                f"RoPE needs {head_dim // 2} frequency factors, one per frequency of its "
                f"{head_dim} rotary dimensions, got {len(rope.frequency_factors)}"
            )
        inv_freq = inv_freq / torch.tensor(rope.frequency_factors, dtype=torch.float32)
    if rope.kind == "longrope":
        factors = rope.long_factor if long else rope.short_factor
        if factors is None or len(factors) != head_dim // 2:
            raise ValueError(
                f"LongRoPE needs {head_dim // 2} short_factor and long_factor values, one per "
                f"frequency of its {head_dim} rotary dimensions"
            )
        return inv_freq / torch.tensor(factors, dtype=torch.float32)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "proportional":
        turning = int(rope.proportion * head_dim // 2)
        inv_freq[turning:] = 0.0  # cos 1, sin 0: those dimensions pass through
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        return _llama3_scaled(inv_freq, rope)
    if rope.kind == "yarn":
        return _yarn_scaled(inv_freq, rope, head_dim)
    return inv_freq


def attention_factor(rope: RopeConfig) -> float:
    """YaRN's and LongRoPE's scale of cos and sin (1 for other kinds): given; for
    LongRoPE sqrt(1 + ln(factor) / ln(original context)); for YaRN 0.1 ln(factor) + 1, or
    with DeepSeek's ``mscale``/``mscale_all_dim`` the ratio of two such terms."""
    if rope.kind not in ("yarn", "longrope"):
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.kind == "longrope":
        if rope.factor <= 1:
            return 1.0
        return math.sqrt(
            1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings)
        )

    def mscale(weight: float) -> float:
        return 1.0 if rope.factor <= 1 else 0.1 * weight * math.log(rope.factor) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return mscale(rope.mscale) / mscale(rope.mscale_all_dim)
    return mscale(1.0)


def _yarn_scaled(inv_freq: torch.Tensor, rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """YaRN (NTK-by-parts): frequencies that turn more than ``beta_fast`` times over the
    original context keep their value, those that turn fewer than ``beta_slow`` times
    are divided by ``factor``, and a linear ramp over the dimensions blends between."""

    def dimension_of(rotations: float) -> float:
        turns = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(rope.theta))

    low, high = dimension_of(rope.beta_fast), dimension_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths are divided by ``factor``, short ones
    kept, and the band between them interpolated smoothly."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables; ``lookup(positions)`` is done once per forward and
    shared by every layer."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        # A model built on the meta device (its weights filled from the checkpoint
        # afterwards) still needs its tables: they are made on the CPU and move with it.
        device = torch.get_default_device()
        # LongRoPE: the short table's rows, then the long one's (``long_offset`` rows on).
        kinds = (False, True) if rope.kind == "longrope" else (False,)
        self.long_offset = max_positions if rope.kind == "longrope" else None
        with torch.device("cpu" if device.type == "meta" else device):
            positions = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.cat(
                [
                    torch.outer(positions, inverse_frequencies(rope, head_dim, long))
                    for long in kinds
                ]
            )
        angles = torch.cat([freqs, freqs], dim=-1)
        scale = attention_factor(rope)
        self.register_buffer("cos", angles.cos() * scale, persistent=False)
        self.register_buffer("sin", angles.sin() * scale, persistent=False)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [num_tokens, 1, head_dim], broadcast over heads.
        ``positions``: rows of the table (LongRoPE's long rows are ``long_offset`` on)."""
        cos = self.cos.index_select(0, positions).to(dtype)[:, None]
        sin = self.sin.index_select(0, positions).to(dtype)[:, None]
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` turned by ``cos``/``sin`` over its leading ``cos.shape[-1]`` dimensions (all
    of them, unless RoPE is partial); the rest pass through."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :dim], cos, sin), x[..., dim:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
