"""DeepSeek's latent attention in a GGUF file: each layer's ``kv_b_proj`` (the latent's
up-projection to every head's key and value rows), which the model reads as one float
matrix (``models/layers.py``'s ``Matrix``), split per head by the absorbed attention.

llama.cpp's converter writes it in two halves, laid out for its own absorbed attention:
``attn_k_b``, each head's key rows transposed ([heads, kv_lora_rank, qk_nope_head_dim]
rows first), and ``attn_v_b``, each head's value rows ([heads, v_head_dim,
kv_lora_rank]). Files from before that split hold the matrix whole as ``attn_kv_b``
([heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]). Either way the loader gets
the one matrix. A half in quantized blocks is widened with gguf-py's own dequantizer:
the matrix is small, and it is sliced per head, never multiplied as a linear over
blocks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, quants

LATENT = re.compile(r"blk\.(\d+)\.attn_(k_b|v_b|kv_b)\.weight")


@dataclass(frozen=True)
class MadeTensor:
    """A float tensor made here, read like one of ``read_gguf``'s tensors."""

    name: str
    data: np.ndarray
    tensor_type: GGMLQuantizationType


def _widened(tensor: Any) -> np.ndarray:
    """A tensor's values in float32, whatever its type (rows first, as the reader's)."""
    return quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32)


def joined(k_b: np.ndarray, v_b: np.ndarray, where: str) -> np.ndarray:
    """``attn_k_b`` [heads, rank, nope] and ``attn_v_b`` [heads, v, rank] -> kv_b_proj
    [heads * (nope + v), rank]: each head's key rows, then its value rows."""
    if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[:2] != (v_b.shape[0], v_b.shape[2]):
        raise ValueError(
            f"{where}: attn_k_b {list(k_b.shape)} and attn_v_b {list(v_b.shape)} (rows "
            "first) are not [heads, kv_lora_rank, qk_nope_head_dim] and [heads, "
            "v_head_dim, kv_lora_rank]"
        )
    rank = k_b.shape[1]
    rows = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
    return np.ascontiguousarray(rows.reshape(-1, rank))


class LatentKV:
    """Passes a file's tensors on, with each layer's ``attn_k_b`` and ``attn_v_b`` (in
    any order, in any part of a split file) joined into one float ``attn_kv_b``, and a
    whole ``attn_kv_b`` in blocks widened."""

    def __init__(self) -> None:
        self.waiting: dict[str, dict[str, Any]] = {}  # layer -> the half seen so far

    def tensors(self, tensors: Iterable[Any], file_name: str) -> Iterator[Any]:
        for tensor in tensors:
            match = LATENT.fullmatch(tensor.name)
            if match is None:
                yield tensor
                continue
            layer, half = match[1], match[2]
            if half == "kv_b":
                yield self._made(tensor.name, _widened(tensor), [tensor])
                continue
            halves = self.waiting.setdefault(layer, {})
            halves[half] = tensor
            if len(halves) == 2:
                del self.waiting[layer]
                where = f"{file_name}: blk.{layer}"
                values = joined(_widened(halves["k_b"]), _widened(halves["v_b"]), where)
                name = f"blk.{layer}.attn_kv_b.weight"
                yield self._made(name, values, list(halves.values()))

    def finish(self, file_name: str) -> None:
        """Refuse a layer whose other half never came."""
        for layer, halves in self.waiting.items():
            (seen,) = halves
            other = "v_b" if seen == "k_b" else "k_b"
            raise ValueError(f"{file_name}: blk.{layer}.attn_{seen} has no attn_{other}")

    @staticmethod
    def _made(name: str, values: np.ndarray, sources: list[Any]) -> MadeTensor:
        """Kept in float16 where every source was (exactly: those are its values), so the
        model's float format is counted as the file's; else float32."""
        if all(source.tensor_type == GGMLQuantizationType.F16 for source in sources):
            return MadeTensor(name, values.astype(np.float16), GGMLQuantizationType.F16)
        return MadeTensor(name, values, GGMLQuantizationType.F32)
