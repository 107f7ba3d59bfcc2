"""Collectives between the ranks of one machine, through one shared-memory region.

gloo moves each collective through loopback TCP and wakes the peer's threads from the
kernel: about 1.3 ms per all-reduce of one row here, where a decode step of the demo
model takes 1 ms in all. Ranks on one machine instead write their part into their own
slot of a shared region, raise a flag, and spin until every flag is up
(``kernels/shm_barrier.c``); each then reads every slot: 0.011 ms for a float32
all-reduce of one row, which runs whole in C. Every rank sums the slots in rank order,
so all of them hold bitwise the same result. A wait that finds a rank's process gone
raises an error that names the rank.

Region layout: two rows of flags (arrived, departed), one cache line per rank each, then
one slot per rank: a 64-byte header (the payload's byte count) and ``capacity`` bytes.
Exchange ``s`` waits until every rank has departed exchange ``s - 1`` before writing,
so a slot is never overwritten while someone still reads it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
from functools import cache
from multiprocessing import shared_memory
from typing import Any

import torch

from updraft.kernels.build import load

LINE = 64  # bytes: one flag per cache line, and the slot header
FLAG_STRIDE = LINE // 8
DEFAULT_CAPACITY = 16 * 2**20  # bytes per rank per exchange; larger tensors go in chunks
# How long a collective inside a step waits for a rank that is alive but has not
# arrived. Every rank runs the same step, so they arrive close together; the limit is
# generous for ranks that load a large model at different speeds before their first
# collective (graph capture). Workers waiting for the next step wait without limit.
STEP_TIMEOUT_MS = 600_000


@cache
def _barrier() -> ctypes.CDLL:
    lib = load("shm_barrier")
    lib.shm_signal.restype = None
    lib.shm_signal.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    lib.shm_wait.restype = ctypes.c_int64
    lib.shm_wait.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64]
    lib.shm_wait.argtypes.append(ctypes.c_int64)
    lib.shm_all_reduce.restype = ctypes.c_int64
    lib.shm_all_reduce.argtypes = (
        [ctypes.c_void_p] * 3
        + [ctypes.c_int64] * 3
        + [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        + [ctypes.c_int64] * 2
    )
    return lib


def _check_ranks(result: int, world: int, timeout_ms: int) -> int:
    """A wait's result, unless it says rank r exited (-(r + 1)) or did not arrive in
    time (-(world + r + 1)): then the group is broken, and every collective on it would
    wait forever."""
    if -world <= result < 0:
        raise RuntimeError(f"rank {-result - 1} of the parallel group exited")
    if result < 0:
        rank = -result - world - 1
        raise RuntimeError(
            f"rank {rank} of the parallel group has not arrived within "
            f"{timeout_ms / 1000:g} s: it is alive but stuck"
        )
    return result


class SharedMemoryGroup:
    def __init__(
        self, name: str, rank: int, world: int, create: bool, capacity: int = DEFAULT_CAPACITY
    ) -> None:
        self.rank, self.world = rank, world
        self.capacity = -(-capacity // LINE) * LINE
        flags = 2 * world * LINE
        size = flags + world * (LINE + self.capacity)
        # Rank 0 unlinks the region. Workers it spawned share its resource tracker, so
        # their opening it registers nothing new, and their exit unlinks nothing.
        try:
            self.memory = shared_memory.SharedMemory(name=name, create=create, size=size)
        except FileExistsError:  # left by a process that was killed: not in use
            shared_memory.SharedMemory(name=name).unlink()
            self.memory = shared_memory.SharedMemory(name=name, create=create, size=size)
        self.region = torch.frombuffer(self.memory.buf, dtype=torch.uint8, count=size)
        if create:
            self.region[:flags].zero_()
        # Beside each of this rank's flags, its process id: a waiting rank checks it.
        lines = self.region[:flags].view(torch.int64).view(2 * world, FLAG_STRIDE)
        lines[rank, 1] = lines[world + rank, 1] = os.getpid()
        base = self.region.data_ptr()
        self.arrived, self.departed = base, base + world * LINE
        self.slots = [
            self.region[flags + r * (LINE + self.capacity) :][: LINE + self.capacity]
            for r in range(world)
        ]
        self.sequence = 0
        self.owner = create
        self.step_timeout_ms = STEP_TIMEOUT_MS

    def _exchange(self, payload: torch.Tensor, timeout_ms: int | None = None) -> list[torch.Tensor]:
        """Every rank's ``payload`` (bytes, as uint8 views into the region), once every
        rank has written its own; call ``_depart`` when done reading them."""
        nbytes = payload.numel() * payload.element_size()
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} bytes exceed the {self.capacity}-byte exchange slot")
        timeout_ms = self.step_timeout_ms if timeout_ms is None else timeout_ms
        self.sequence += 1
        self._wait(self.departed, self.sequence - 1, timeout_ms)
        slot = self.slots[self.rank]
        slot[:8].view(torch.int64)[0] = nbytes
        if nbytes:
            slot[LINE : LINE + nbytes].copy_(payload.reshape(-1).view(torch.uint8))
        _barrier().shm_signal(self.arrived + self.rank * LINE, self.sequence)
        self._wait(self.arrived, self.sequence, timeout_ms)
        return [s[LINE : LINE + int(s[:8].view(torch.int64)[0])] for s in self.slots]

    def _wait(self, flags: int, value: int, timeout_ms: int) -> None:
        result = _barrier().shm_wait(flags, self.world, FLAG_STRIDE, value, timeout_ms)
        _check_ranks(result, self.world, timeout_ms)

    def _depart(self) -> None:
        _barrier().shm_signal(self.departed + self.rank * LINE, self.sequence)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu":  # a decode step's case
            flat = x.contiguous()
            out = torch.empty_like(flat)
            self.sequence = _check_ranks(
                _barrier().shm_all_reduce(
                    self.arrived,
                    self.departed,
                    self.slots[0].data_ptr(),
                    LINE + self.capacity,
                    LINE,
                    self.capacity,
                    self.rank,
                    self.world,
                    flat.data_ptr(),
                    out.data_ptr(),
                    flat.numel(),
                    self.sequence,
                    self.step_timeout_ms,
                ),
                self.world,
                self.step_timeout_ms,
            )
            return out
        flat = x.contiguous().reshape(-1)
        out = torch.empty_like(flat)
        step = self.capacity // flat.element_size()
        for start in range(0, max(flat.numel(), 1), step):
            part = flat[start : start + step]
            slots = [s.view(flat.dtype) for s in self._exchange(part)]
            # Half-precision parts are summed in float32, then rounded once.
            total = slots[0].to(torch.promote_types(flat.dtype, torch.float32), copy=True)
            for other in slots[1:]:  # in rank order: every rank sums alike
                total += other
            out[start : start + step] = total
            self._depart()
        return out.view(x.shape)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.contiguous().reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
        parts = []
        step = max(1, self.capacity // max(1, rows.shape[1] * rows.element_size()))
        for start in range(0, max(rows.shape[0], 1), step):
            chunk = rows[start : start + step]
            slots = self._exchange(chunk)
            parts.append(torch.cat([s.view(x.dtype).view(chunk.shape) for s in slots], dim=-1))
            self._depart()
        gathered = torch.cat(parts).view(*x.shape[:-1], x.shape[-1] * self.world)
        return gathered.to(x.device)  # a device tensor goes through host memory

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x``, in rank order, concatenated along the first dim."""
        flat = x.contiguous().reshape(-1)
        out = torch.empty(self.world, flat.numel(), dtype=x.dtype, device=x.device)
        step = self.capacity // flat.element_size()
        for start in range(0, max(flat.numel(), 1), step):
            slots = self._exchange(flat[start : start + step])
            for rank, slot in enumerate(slots):
                out[rank, start : start + step] = slot.view(x.dtype)
            self._depart()
        return out.view(self.world * x.shape[0], *x.shape[1:])

    def broadcast_object(self, value: Any = None, root: int = 0) -> Any:
        """``value`` from rank ``root``, pickled: its size first, then its bytes in as
        many exchanges as the slot needs (every rank runs the same count)."""
        data = pickle.dumps(value) if self.rank == root else b""
        # The root waits for ranks that are waiting for it; they wait as long as it
        # has no step for them (an idle engine).
        timeout_ms = self.step_timeout_ms if self.rank == root else 0
        size = self._exchange(torch.tensor([len(data)]), timeout_ms)[root]
        size = size.view(torch.int64).item()
        self._depart()
        received = bytearray()
        for start in range(0, size, self.capacity):
            chunk = (
                torch.frombuffer(bytearray(data[start : start + self.capacity]), dtype=torch.uint8)
                if data
                else torch.empty(0, dtype=torch.uint8)
            )
            received += self._exchange(chunk, timeout_ms)[root].numpy().tobytes()
            self._depart()
        return value if self.rank == root else pickle.loads(received)

    def close(self) -> None:
        del self.region, self.slots
        self.memory.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):  # a peer's tracker got there first
                self.memory.unlink()
