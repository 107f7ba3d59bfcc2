"""A recording's intermediates, whose bytes go back as soon as the forward drops them.

A recorded graph keeps every tensor its ops made (a replay writes each again), but
until the arena is laid out (``arena.py``) it needs of a tensor nothing but its size,
dtype, strides and which ops touch it: not its contents, once no op can read it again.
Kept with their contents, a 256-token prefill bucket of a 100M model held about 250
MiB of activations at the end of its recording, for an arena of 9.

So the graph's nodes hold aliases of their own (new tensor objects over the same
storage) instead of the forward's tensors. Once nothing but those aliases holds a
storage (the forward let go of every tensor over it, and no op is running on it), no
later op can read it: its bytes are freed, and the aliases keep the shape of what was
there. The storage keeps its identity for the arena: a storage without bytes has no
address, and the address it had may go to a tensor made later, so a freed storage is
known by a key of its own (``key``), below zero, where an address cannot be.

A storage is freed only when its use count says the aliases are all that hold it: a
tensor the forward kept some other way (``.data``, a C++ holder) keeps it whole.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch

from updraft.graph.recorded_nodes import storage_of
from updraft.resident import give_back_free_memory

# Freed bytes after which the allocator's free pages go back to the system (below).
TRIM_EVERY_BYTES = 8 * 2**20


class _Tracked(NamedTuple):
    storage: torch.UntypedStorage  # held, so its use count has exactly one wrapper in it
    aliases: list[torch.Tensor]  # the graph's own tensors over it


class Intermediates:
    """The storages a recording produced that it may free early: not a weight's, the KV
    cache's or a static input's (``kept``). ``held`` swaps the forward's tensors for the
    graph's aliases; ``free_dead`` frees the storages the forward has let go of."""

    def __init__(self, kept: set[int]) -> None:
        self.kept = kept
        self.tracked: dict[int, _Tracked] = {}  # address -> storage not yet freed
        # id of a forward's tensor -> (a weak reference to it, its alias): one alias per
        # tensor, since runs tell values apart by the tensor object.
        self.alias_of: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self.freed: dict[int, tuple[int, int]] = {}  # storage's _cdata -> (key, bytes)
        self.untrimmed = 0  # bytes freed since the last trim
        self.unchecked = 0  # ops recorded since the tracked storages were last looked at

    def track(self, tensors: list[torch.Tensor]) -> None:
        """Outputs of an op: their storages may be freed once dead."""
        for tensor in tensors:
            if tensor.is_mkldnn:
                continue
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
            if address == 0 or address in self.kept or address in self.tracked:
                continue
            if storage.resizable():  # a storage numpy or a file shares cannot be freed
                self.tracked[address] = _Tracked(storage, [])

    def held(self, value: Any) -> Any:
        """``value`` (an op's arguments or results) with each tensor over a tracked
        storage replaced by the graph's alias of it."""
        if isinstance(value, torch.Tensor):
            return self._alias(value)
        if isinstance(value, (tuple, list)):
            items = [self.held(item) for item in value]
            if all(new is old for new, old in zip(items, value, strict=True)):
                return value
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        if isinstance(value, dict):
            return {key: self.held(item) for key, item in value.items()}
        return value

    def _alias(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_mkldnn:
            return tensor
        entry = self.alias_of.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            return entry[1]
        tracked = self.tracked.get(tensor.untyped_storage().data_ptr())
        if tracked is None:
            return tensor
        alias = tensor.detach()
        tracked.aliases.append(alias)
        self.alias_of[id(tensor)] = (weakref.ref(tensor), alias)
        return alias

    def free_dead(self) -> list[int]:
        """After each op: frees each tracked storage nothing but its aliases and wrapper
        holds. -> the addresses it had. A forward that keeps many tensors alive is looked
        over once every ``len(tracked) // 32`` ops, not at every op: capture stays
        linear in the ops, and what died waits a few ops at most."""
        self.unchecked += 1
        if self.unchecked < len(self.tracked) // 32:
            return []
        self.unchecked = 0
        dead = [
            address
            for address, tracked in self.tracked.items()
            if torch._C._storage_Use_Count(tracked.storage._cdata) <= len(tracked.aliases) + 1
        ]
        for address in dead:
            storage = self.tracked.pop(address).storage
            self.freed[storage._cdata] = (-1 - len(self.freed), storage.nbytes())
            self.untrimmed += storage.nbytes()
            storage.resize_(0)
        # glibc's heap keeps freed activations between the small objects made after
        # them (tensor objects, the nodes), and a later activation of another size
        # seldom fits the hole: the heap would grow by most of what was freed.
        if self.untrimmed >= TRIM_EVERY_BYTES:
            give_back_free_memory()
            self.untrimmed = 0
        return dead

    def freed_keys(self) -> set[int]:
        return {key for key, _ in self.freed.values()}

    def key(self, tensor: torch.Tensor) -> int:
        """``storage_of``, or a freed storage's own key."""
        if not tensor.is_mkldnn:
            storage = tensor.untyped_storage()
            if storage.data_ptr() == 0 and storage._cdata in self.freed:
                return self.freed[storage._cdata][0]
        return storage_of(tensor)

    def nbytes(self, tensor: torch.Tensor) -> int:
        """The bytes of ``tensor``'s storage, freed or not."""
        storage = tensor.untyped_storage()
        freed = self.freed.get(storage._cdata) if storage.data_ptr() == 0 else None
        return storage.nbytes() if freed is None else freed[1]
