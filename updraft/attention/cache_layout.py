"""What one layer's paged KV cache holds per slot, by attention kind.

A slot is one token position of one block (``block * block_size + offset``); every
layer's cache has ``num_blocks * block_size + 1`` of them, the last a spare that takes
the writes of padded tokens (slot -1). The block pool, prefix cache and capacity
planning count blocks and never look inside a slot, so a new attention kind is a new
layout here and nothing else changes above the model. A model's caches as a whole, paged
and recurrent, are its cache groups (``cache_groups.py``).

* GQA (Llama, Qwen): ``[2, slots, kv_heads, head_dim]``, keys then values; in an int8
  cache ``[2, slots, kv_heads, head_dim + 4]``, each head row's codes and then their
  float32 scale (``kv_int8.py``).
* MLA (DeepSeek): ``[slots, kv_lora_rank + qk_rope_head_dim]``, the normalised latent
  ``c_kv`` and the rotated shared key ``k_pe``, not expanded keys and values; with the
  V3.2 indexer, its ``index_head_dim`` key follows in the same row.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from updraft.kernels.attention_ops import INT8_SCALE_BYTES
from updraft.model_config import ModelConfig


@dataclass(frozen=True)
class CacheLayout:
    before_slots: tuple[int, ...]  # dims in front of the slot dim (GQA: K and V)
    per_slot: tuple[int, ...]  # the shape of one slot

    def shape(self, num_slots: int) -> tuple[int, ...]:
        return (*self.before_slots, num_slots, *self.per_slot)

    @property
    def slot_dim(self) -> int:
        return len(self.before_slots)

    @property
    def values_per_slot(self) -> int:
        return math.prod(self.before_slots) * math.prod(self.per_slot)


def cache_layout(config: ModelConfig, layer: int = 0, quantized: bool = False) -> CacheLayout:
    """Decoder layer ``layer``'s slot (Gemma 4's full layers differ from its sliding
    ones in head size and KV heads); ``quantized``: in an int8 cache."""
    if quantized:
        if config.mla is not None:
            raise ValueError(
                "kv_cache_dtype 'int8' does not cover the latent cache of multi-head latent "
                f"attention (MLA, {config.architecture}): use kv_cache_dtype 'auto'"
            )
        row = config.layer_head_dim(layer) + INT8_SCALE_BYTES
        return CacheLayout(before_slots=(2,), per_slot=(config.layer_kv_heads(layer), row))
    if config.mla is not None:
        width = config.mla.kv_lora_rank + config.mla.qk_rope_head_dim
        if config.indexer is not None:
            width += config.indexer.head_dim
        return CacheLayout(before_slots=(), per_slot=(width,))
    return CacheLayout(
        before_slots=(2,), per_slot=(config.layer_kv_heads(layer), config.layer_head_dim(layer))
    )


def zeros_on_first_write(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor on an anonymous mapping of its own: the OS maps each page on its
    first write, so a large KV budget costs memory only as blocks fill (``torch.zeros``
    would write, and so map, every byte up front). Not through malloc: calloc writes
    zeros over any memory it hands out again, which, once the engine keeps freed memory
    (``runner/freed_memory.py``), is where a later engine's cache would come from."""
    nbytes = math.prod(shape) * dtype.itemsize
    memory = mmap.mmap(-1, nbytes)  # unmapped when the tensor, which holds it, is freed
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)
