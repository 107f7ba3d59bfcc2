"""The collectives a sharded model calls inside a step, as torch ops.

``torch.ops.updraft.all_reduce(x, group)``, ``all_gather(x, group, world)`` (along the
first dim) and ``all_gather_last(x, group, world)`` run on a process group registered
here by name. As ops they are seen by the dispatcher: a captured graph records each
one with its tensors and replays it like a matmul, so a collective is never a host
value baked into a graph. Every rank runs the same ops in the same order (the same
step, the same bucket), which is what keeps them matched.

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
from updraft.parallel.topology import GroupRank, RankPlace

_GROUPS: dict[str, dist.ProcessGroup] = {}
_SHARED: dict[str, SharedMemoryGroup] = {}


def connect(
    place: RankPlace,
    port: int,
    host: str = "127.0.0.1",
    store_hosted: bool = False,
    one_machine: bool = True,
    timeout_seconds: float = 300.0,
    nccl: bool = False,
) -> None:
    """Join the world group of ``place`` through the TCP store at ``host:port`` (hosted
    by rank 0, or already by a launcher such as torchrun: then ``store_hosted``), then
    each of its subgroups, and register them all for the collective ops. Ranks all on
    ``one_machine`` exchange through shared memory; others through gloo. With ``nccl``
    the subgroups, which carry the collectives inside a step, are NCCL groups over
    each rank's own GPU; the world group, which carries the step, stays on the host."""
    timeout = timedelta(seconds=timeout_seconds)
    world = place.world
    is_host = world.rank == 0 and not store_hosted
    store = dist.TCPStore(host, port, world.size, is_host, timeout=timeout)
    # Every rank joins its groups in the same order (world, tensor, prefill context,
    # decode context), and groups of one kind are disjoint, so no two ranks wait on
    # each other in opposite orders.
    _join(store, world, one_machine, timeout)
    for group, _ in place.subgroups():
        if nccl:
            prefixed = dist.PrefixStore(group.group, store)
            _GROUPS[group.group] = dist.ProcessGroupNCCL(prefixed, group.rank, group.size)
        else:
            _join(store, group, one_machine, timeout)


def _join(store: dist.Store, rank: GroupRank, one_machine: bool, timeout: timedelta) -> None:
    group = dist.ProcessGroupGloo(
        dist.PrefixStore(rank.group, store), rank.rank, rank.size, timeout
    )
    _GROUPS[rank.group] = group
    if one_machine:
        # The region is named after the group: unique per engine and per group.
        if rank.rank == 0:
            _SHARED[rank.group] = SharedMemoryGroup(rank.group, rank.rank, rank.size, True)
        group.barrier().wait()  # rank 0's region exists before the others open it
        if rank.rank != 0:
            _SHARED[rank.group] = SharedMemoryGroup(rank.group, rank.rank, rank.size, False)
        group.barrier().wait()


def forget(place: RankPlace) -> None:
    for rank in [place.world] + [group for group, _ in place.subgroups()]:
        _GROUPS.pop(rank.group, None)
        shared = _SHARED.pop(rank.group, None)
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


def all_gather(x: torch.Tensor, group: str, world: int) -> torch.Tensor:
    """Every rank's ``x``, in rank order, concatenated along the first dim."""
    if group in _SHARED:
        return _SHARED[group].all_gather(x)
    parts = [torch.empty_like(x) for _ in range(world)]
    _group(group).allgather([parts], [x.contiguous()]).wait()
    return torch.cat(parts)


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
_LIBRARY.define("all_gather(Tensor x, str group, int world) -> Tensor")
_LIBRARY.impl("all_gather", all_gather, "CompositeExplicitAutograd")
_LIBRARY.impl(
    "all_gather", lambda x, group, world: x.new_empty(x.shape[0] * world, *x.shape[1:]), "Meta"
)
