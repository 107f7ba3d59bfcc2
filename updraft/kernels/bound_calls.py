"""The kernel ops a replayed graph calls straight into C.

Through the dispatcher, one of updraft's ops costs about 20-40 microseconds before its
kernel starts (boxing the arguments into Python, the checks, allocating the result);
a small model's decode step makes some sixty such calls, which at batch 1 took about a
fifth of the step. A graph replays each op on the very tensors it was captured with, so
the checks hold as they did at capture and every address is known: the op's ``Launch``
is built once, writing into the captured outputs, and each replay is one C call.

Where a launch would read a copy made when it was built (an input that was not
contiguous), the op is replayed through the dispatcher as any other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from updraft.kernels.attention_ops import paged_decode_attention_launch, write_kv_launch
from updraft.kernels.gguf_ops import (
    gguf_gemm_int8_launch,
    gguf_linear_int8_launch,
    gguf_linear_launch,
)
from updraft.kernels.launch import Launch
from updraft.kernels.ops import panel_linear_launch

_LAUNCHES: dict[Any, Callable[..., Launch]] = {
    torch.ops.updraft.panel_linear.default: panel_linear_launch,
    torch.ops.updraft.paged_decode_attention.default: paged_decode_attention_launch,
    torch.ops.updraft.gguf_linear.default: gguf_linear_launch,
    torch.ops.updraft.gguf_linear_int8.default: gguf_linear_int8_launch,
    torch.ops.updraft.gguf_gemm_int8.default: gguf_gemm_int8_launch,
    torch.ops.updraft.write_kv.default: write_kv_launch,
}


def has_bound_call(func: Any) -> bool:
    """Whether ``func`` is replayed as a bound call (so it is kept out of fused runs)."""
    return func in _LAUNCHES


def bound_call(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outputs: list[torch.Tensor]
) -> Callable[[], Any] | None:
    """``func`` on ``args`` as one C call writing into ``outputs`` (none for an op that
    writes its arguments in place: the recorded graph keeps no outputs for those), or None
    where it cannot be bound."""
    make = _LAUNCHES.get(func)
    if make is None:
        return None
    launch = make(*args, **kwargs, out=tuple(outputs) or None)
    return None if launch.copied_inputs else launch
