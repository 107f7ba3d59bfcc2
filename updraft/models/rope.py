"""Rotary position embeddings (the rotate-half layout Hugging Face Llama checkpoints use)."""

from __future__ import annotations

import math

import torch

from updraft.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        return _llama3_scaled(inv_freq, rope)
    if rope.kind == "yarn":
        return _yarn_scaled(inv_freq, rope, head_dim)
    return inv_freq


def attention_factor(rope: RopeConfig) -> float:
    """YaRN's scale of cos and sin (1 for other kinds): given, or 0.1 ln(factor) + 1,
    or with DeepSeek's ``mscale``/``mscale_all_dim`` the ratio of two such terms."""
    if rope.kind != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor

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
        with torch.device("cpu" if device.type == "meta" else device):
            positions = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.outer(positions, inverse_frequencies(rope, head_dim))
        angles = torch.cat([freqs, freqs], dim=-1)
        scale = attention_factor(rope)
        self.register_buffer("cos", angles.cos() * scale, persistent=False)
        self.register_buffer("sin", angles.sin() * scale, persistent=False)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [num_tokens, 1, head_dim], broadcast over heads."""
        cos = self.cos.index_select(0, positions).to(dtype)[:, None]
        sin = self.sin.index_select(0, positions).to(dtype)[:, None]
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
