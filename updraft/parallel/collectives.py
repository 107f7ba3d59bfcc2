"""The collectives a sharded model calls inside a step, as torch ops.

``torch.ops.updraft.all_reduce(x, group)`` and ``all_gather_last(x, group, world)`` run
on a process group registered here by name. As ops they are seen by the dispatcher: a
captured graph records each one with its tensors and replays it like a matmul, so a
collective is never a host value baked into a graph. Every rank runs the same ops in the
same order (the same step, the same bucket), which is what keeps them matched.

Groups are plain ``ProcessGroupGloo`` objects over their own TCP store, not torch's
default group, so that one process may hold several engines (tests do) and a rank joins
exactly the group its engine made.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_GROUPS: dict[str, dist.ProcessGroup] = {}


def connect(
    name: str, rank: int, world_size: int, port: int, timeout_seconds: float = 300.0
) -> dist.ProcessGroup:
    """Join group ``name`` of ``world_size`` ranks whose rank 0 listens on ``port`` of
    this machine (gloo on the CPU), and register it for the collective ops."""
    timeout = timedelta(seconds=timeout_seconds)
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world_size, timeout)
    _GROUPS[name] = group
    return group


def forget(name: str) -> None:
    _GROUPS.pop(name, None)


def _group(name: str) -> dist.ProcessGroup:
    group = _GROUPS.get(name)
    if group is None:
        raise RuntimeError(f"process group {name!r} is not connected in this process")
    return group


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group``."""
    out = x.contiguous().clone()
    _group(group).allreduce([out]).wait()
    return out


def all_gather_last(x: torch.Tensor, group: str, world: int) -> torch.Tensor:
    """Every rank's ``x``, in rank order, concatenated along the last dim."""
    parts = [torch.empty_like(x) for _ in range(world)]
    _group(group).allgather([parts], [x.contiguous()]).wait()
    return torch.cat(parts, dim=-1)


def broadcast_object(group: str, value: Any = None, root: int = 0) -> Any:
    """``value`` from rank ``root`` to every rank of ``group`` (pickled), returned on
    each: the step rank 0 planned, which every other rank then runs."""
    options = dist.BroadcastOptions()
    options.rootRank = root
    is_root = _group(group).rank() == root
    payload = (
        torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8) if is_root else None
    )
    size = torch.tensor([0 if payload is None else payload.numel()])
    _group(group).broadcast([size], options).wait()
    if not is_root:
        payload = torch.empty(int(size), dtype=torch.uint8)
    _group(group).broadcast([payload], options).wait()
    return value if is_root else pickle.loads(payload.numpy().tobytes())


_LIBRARY = torch.library.Library("updraft", "FRAGMENT")
_LIBRARY.define("all_reduce(Tensor x, str group) -> Tensor")
_LIBRARY.impl("all_reduce", all_reduce, "CompositeExplicitAutograd")
_LIBRARY.impl("all_reduce", lambda x, group: torch.empty_like(x), "Meta")
_LIBRARY.define("all_gather_last(Tensor x, str group, int world) -> Tensor")
_LIBRARY.impl("all_gather_last", all_gather_last, "CompositeExplicitAutograd")
_LIBRARY.impl(
    "all_gather_last",
    lambda x, group, world: x.new_empty(*x.shape[:-1], x.shape[-1] * world),
    "Meta",
)
