"""The collectives a sharded model calls inside a step, as torch ops.

``torch.ops.updraft.all_reduce(x, group)`` and ``all_gather_last(x, group, world)`` run
on a process group registered here by name. As ops they are seen by the dispatcher: a
captured graph records each one with its tensors and replays it like a matmul, so a
collective is never a host value baked into a graph. Every rank runs the same ops in the
same order (the same step, the same bucket), which is what keeps them matched.

Groups are plain ``ProcessGroupGloo`` objects over their own TCP store, not torch's
default group, so that one process may hold several engines (tests do) and a rank joins
exactly the group its engine made. gloo sets the group up; the collectives of a step
then go through shared memory (``parallel/shared_memory.py``), since every rank of a
group is on one machine, where gloo's loopback round trips cost a millisecond each.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from updraft.parallel.shared_memory import SharedMemoryGroup

_GROUPS: dict[str, dist.ProcessGroup] = {}
_SHARED: dict[str, SharedMemoryGroup] = {}


def connect(
    name: str,
    rank: int,
    world_size: int,
    port: int,
    host: str = "127.0.0.1",
    store_hosted: bool = False,
    one_machine: bool = True,
    timeout_seconds: float = 300.0,
) -> dist.ProcessGroup:
    """Join group ``name`` of ``world_size`` ranks through the TCP store at
    ``host:port`` (hosted by rank 0, or already by a launcher such as torchrun: then
    ``store_hosted``), and register it for the collective ops. Ranks all on
    ``one_machine`` exchange through shared memory; others through gloo."""
    timeout = timedelta(seconds=timeout_seconds)
    is_host = rank == 0 and not store_hosted
    store = dist.TCPStore(host, port, world_size, is_host, timeout=timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world_size, timeout)
    _GROUPS[name] = group
    if one_machine:
        region = f"updraft-{port}"
        if rank == 0:
            _SHARED[name] = SharedMemoryGroup(region, rank, world_size, create=True)
        group.barrier().wait()  # rank 0's region exists before the others open it
        if rank != 0:
            _SHARED[name] = SharedMemoryGroup(region, rank, world_size, create=False)
        group.barrier().wait()
    return group


def forget(name: str) -> None:
    _GROUPS.pop(name, None)
    shared = _SHARED.pop(name, None)
    if shared is not None:
        shared.close()


def _group(name: str) -> dist.ProcessGroup:
    group = _GROUPS.get(name)
    if group is None:
        raise RuntimeError(f"process group {name!r} is not connected in this process")
    return group


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group``."""
    if group in _SHARED:
        return _SHARED[group].all_reduce(x)
    out = x.contiguous().clone()
    _group(group).allreduce([out]).wait()
    return out


def all_gather_last(x: torch.Tensor, group: str, world: int) -> torch.Tensor:
    """Every rank's ``x``, in rank order, concatenated along the last dim."""
    if group in _SHARED:
        return _SHARED[group].all_gather_last(x)
    parts = [torch.empty_like(x) for _ in range(world)]
    _group(group).allgather([parts], [x.contiguous()]).wait()
    return torch.cat(parts, dim=-1)


def broadcast_object(group: str, value: Any = None, root: int = 0) -> Any:
    """``value`` from rank ``root`` to every rank of ``group`` (pickled), returned on
    each: the step rank 0 planned, which every other rank then runs."""
    if group in _SHARED:
        return _SHARED[group].broadcast_object(value, root)
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
