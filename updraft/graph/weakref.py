"""Non-owning tensor views, so a captured graph's outputs do not pin their memory."""

from __future__ import annotations

from typing import Any

import torch


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over the same memory that does not keep that memory alive. The caller
    guarantees the memory outlives it (a graph's pool does)."""
    storage = torch._C._construct_storage_from_data_pointer(
        tensor.untyped_storage().data_ptr(), tensor.device, tensor.untyped_storage().nbytes()
    )
    view = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return view.set_(storage, tensor.storage_offset(), tensor.shape, tensor.stride())


def weak_ref_tensors(value: Any) -> Any:
    """``weak_ref_tensor`` through nested lists, tuples and dicts; other values pass."""
    if isinstance(value, torch.Tensor):
        return weak_ref_tensor(value)
    if isinstance(value, list | tuple):
        return type(value)(weak_ref_tensors(item) for item in value)
    if isinstance(value, dict):
        return {key: weak_ref_tensors(item) for key, item in value.items()}
    return value
