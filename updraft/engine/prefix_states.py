"""A hybrid model's prefix states: the recurrent state at the end of cached prefixes.

A prefix-cache hit on a hybrid model needs more than the prefix's KV blocks: its
linear-attention layers continue from the state after the prefix's last token, which
cannot be rebuilt from KV. So the state at a prompt's last full block boundary is kept
in a slot of its own, beside the running requests' slots in the same state tensors
(``attention/cache_groups.py``), under the key of the block it ends (the chained hash
of ``kv_blocks.py``). A hit copies the state into the request's running slot; a save
copies a running slot's row out. No request holds a prefix state, so there are no
reference counts: the least recently used state is overwritten when a new one needs
its slot, and a state whose key is gone is simply a miss.

Both copies run inside a step, before its forward (``StateCopy``; ``Runner.forward``).
A save is planned when a step ends at the boundary, so it runs at the start of the next
step, before any forward of that step can write the running slot, even if the slot has
changed hands in between (finish, abort or preemption only hand a slot back; nothing
writes it until a forward). Copies run in the order planned: a hit found in the step
after a save reads the state that save writes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from updraft.step.plan import StateCopy

BlockKey = bytes  # a block's key in the prefix cache (``kv_blocks.hash_block``)


@dataclass(frozen=True)
class PrefixStateStats:
    used: int  # states stored
    total: int  # slots for them
    hits: int  # requests that resumed from one
    saves: int  # states stored so far, overwritten ones included


class PrefixStates:
    def __init__(self, first_slot: int, num_slots: int, depth: int) -> None:
        """``num_slots`` prefix slots from slot ``first_slot`` of the state tensors
        (after the running requests' slots); ``depth``: rows per slot (a row per
        position modulo ``depth``, ``models/delta_rule.py``)."""
        self.first_slot = first_slot
        self.num_slots = num_slots
        self.depth = depth
        self.slots: OrderedDict[BlockKey, int] = OrderedDict()  # least recently used first
        self.free_slots = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self.num_hits = 0  # requests that resumed from a stored state
        self.num_saves = 0

    @property
    def num_used(self) -> int:
        return len(self.slots)

    def stats(self) -> PrefixStateStats:
        return PrefixStateStats(self.num_used, self.num_slots, self.num_hits, self.num_saves)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self.slots

    def restore(self, key: BlockKey, running_slot: int, start: int) -> StateCopy:
        """The copy that resumes a request at position ``start`` from the state stored
        under ``key`` (the key of the block that ends at ``start``), into row
        ``(start - 1) % depth`` of its running slot, where its first step reads it."""
        slot = self.slots[key]
        self.slots.move_to_end(key)
        self.num_hits += 1
        return StateCopy(slot, 0, running_slot, (start - 1) % self.depth)

    def save(self, key: BlockKey, running_slot: int, end: int) -> StateCopy | None:
        """The copy that stores a request's state after position ``end - 1`` (row
        ``(end - 1) % depth`` of its running slot) under ``key``, overwriting the least
        recently used state when no slot is free; None when that state is already
        stored (it is the same state: the key covers every token before it) or there
        are no prefix slots."""
        if key in self.slots:
            self.slots.move_to_end(key)
            return None
        if not self.num_slots:
            return None
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            _, slot = self.slots.popitem(last=False)
        self.slots[key] = slot
        self.num_saves += 1
        return StateCopy(running_slot, (end - 1) % self.depth, slot, 0)
