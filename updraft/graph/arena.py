"""One block of memory for a recorded graph's intermediates, reused as they die.

A recorded graph keeps every tensor an op produced (the replay writes into it again),
so as captured it would hold all of its intermediates at once: a 512-token prefill step
of a 100M model would keep about 330 MB, a dozen layers' activations side by side, and
a replay would walk through all of it, cold (the capture itself frees their bytes as
the forward drops them, ``intermediates.py``, but keeps their places to fill). A device
graph's memory pool reuses what a tensor freed for the tensors made after it; this does
the same after the fact. Each
produced storage lives from the first to the last replay call that touches it; storages
whose lives do not overlap share bytes of one arena, and the captured tensors are
remade as views of their places in it, with the same sizes, strides and offsets.

Graphs that never replay at once (a runner's buckets: it runs one step at a time) share
one arena (``SharedArena``): each graph's is the head of one block, as large as the
largest graph needs, rather than a block per graph.

Lives are counted in replay calls, not ops: a compiled run reads its inputs and writes
its results in one fused call, so a result may not take the bytes of anything the same
run reads; what one call makes and uses up goes into a block of its own, laid out op by
op, for replays op by op. What the graph returns, and whatever it did not produce
(weights, the KV cache, static inputs, folded constants), stays where it is.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from updraft.graph.recorded_nodes import OpNode, TaskNode, storage_of, tensors_in

ALIGNMENT = 64  # bytes: a cache line, and every vector load's alignment


class SharedArena:
    """One block for the arenas of graphs of which only one replays at a time: each
    takes its head; a graph that needs more than the block holds gets a larger block,
    which the graphs after it share (capture the largest first and there is one)."""

    def __init__(self) -> None:
        self.block: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        if self.block is None or self.block.numel() < nbytes:
            self.block = torch.zeros(nbytes, dtype=torch.uint8)
        return self.block[:nbytes]


def place_in_arena(
    nodes: Sequence[OpNode | TaskNode],
    calls: Sequence[int],
    movable: set[int],
    shared: SharedArena | None = None,
    key: Callable[[torch.Tensor], int] = storage_of,
    nbytes: Callable[[torch.Tensor], int] = lambda tensor: tensor.untyped_storage().nbytes(),
) -> torch.Tensor | None:
    """Moves the storages in ``movable`` (produced by the graph, not returned) into one
    arena (the head of ``shared``'s block, if given), rewriting every node's tensors in
    place; ``calls[i]`` is the replay call node i runs in. ``key`` and ``nbytes``: a
    tensor's storage and its size (a capture's own, for storages it freed). -> the
    arena, which the graph must keep (None when nothing moved into it)."""
    lives: dict[int, tuple[int, int]] = {}  # in replay calls
    steps: dict[int, tuple[int, int]] = {}  # in nodes
    sizes: dict[int, int] = {}
    for index, (node, call) in enumerate(zip(nodes, calls, strict=True)):
        for tensor in tensors_in(_contents(node)):
            if tensor.is_mkldnn:
                continue
            storage = key(tensor)
            if storage in movable:
                lives[storage] = (lives.get(storage, (call, call))[0], call)
                steps[storage] = (steps.get(storage, (index, index))[0], index)
                sizes[storage] = nbytes(tensor)
    # What one fused call both makes and uses up never leaves it: a compiled run keeps
    # it in registers or scratch of its own, so it takes no place in the arena. Only a
    # replay op by op reads it (before the runs are compiled, or a run inductor could
    # not compile): it goes into a block of its own, laid out op by op, which the nodes
    # alone hold, and which goes with them once the runs are compiled.
    nodes_per_call = Counter(calls)
    inside = {
        storage: steps[storage]
        for storage, (born, dies) in lives.items()
        if born == dies and nodes_per_call[born] > 1
    }
    lives = {storage: life for storage, life in lives.items() if storage not in inside}
    places: dict[int, torch.UntypedStorage] = {}
    arena = None
    if lives:
        offsets, total = arena_offsets(lives, sizes)
        # Zeroed once: rows a replay skips (``TokenRows``) keep what was last written
        # there (by this graph or, shared, another), which no live row reads.
        arena = torch.zeros(total, dtype=torch.uint8) if shared is None else shared.take(total)
        places |= _places(arena, offsets, sizes)
    if inside:
        offsets, total = arena_offsets(inside, sizes)
        places |= _places(torch.zeros(total, dtype=torch.uint8), offsets, sizes)
    if not places:
        return None
    _rewrite(nodes, places, key)
    return arena


def _rewrite(
    nodes: Sequence[OpNode | TaskNode],
    places: dict[int, torch.UntypedStorage],
    key: Callable[[torch.Tensor], int],
) -> None:
    """Every node's tensors over a storage in ``places`` remade as views of its place."""
    # Each tensor's new self (itself where it stays), by id: one tensor stays one tensor
    # (runs key values by id), and a tensor many nodes read is looked at once. The nodes
    # hold every tensor alive through the walk, so no id is reused.
    remade: dict[int, torch.Tensor] = {}

    def moved(leaf: torch.Tensor) -> torch.Tensor:
        new = remade.get(id(leaf))
        if new is None:
            place = None if leaf.is_mkldnn else places.get(key(leaf))
            new = (
                leaf
                if place is None
                else torch.empty(0, dtype=leaf.dtype).set_(
                    place, leaf.storage_offset(), leaf.shape, leaf.stride()
                )
            )
            remade[id(leaf)] = new
        return new

    for node in nodes:
        contents = _contents(node)
        rewritten = _rebuilt(contents, moved)
        if rewritten is not contents:
            _assign(node, rewritten)


def _places(
    block: torch.Tensor, offsets: dict[int, int], sizes: dict[int, int]
) -> dict[int, torch.UntypedStorage]:
    """Each storage's bytes of ``block``, at its offset."""
    whole = block.untyped_storage()
    return {storage: whole[offset : offset + sizes[storage]] for storage, offset in offsets.items()}


def _contents(node: OpNode | TaskNode) -> tuple[Any, ...]:
    """The node's arguments and results."""
    if isinstance(node, TaskNode):
        return (node.kwargs, node.output)
    return (node.args, node.kwargs, node.outputs)


def _assign(node: OpNode | TaskNode, contents: tuple[Any, ...]) -> None:
    if isinstance(node, TaskNode):
        node.kwargs, node.output = contents
    else:
        node.args, node.kwargs, node.outputs = contents


def _rebuilt(value: Any, moved: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by ``moved(tensor)``: the very same object
    where nothing inside it changed."""
    if isinstance(value, torch.Tensor):
        return moved(value)
    if isinstance(value, (tuple, list)):
        # Most items are tensors or plain numbers: taken here, not by another call.
        items = [
            moved(item)
            if isinstance(item, torch.Tensor)
            else _rebuilt(item, moved)
            if isinstance(item, (tuple, list, dict))
            else item
            for item in value
        ]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        items = {key: _rebuilt(item, moved) for key, item in value.items()}
        if all(items[key] is item for key, item in value.items()):
            return value
        return type(value)(items)
    return value


def arena_offsets(
    lives: dict[int, tuple[int, int]], sizes: dict[int, int]
) -> tuple[dict[int, int], int]:
    """An offset for each storage, whose ``lives`` are (first call, last call) and
    ``sizes`` bytes, such that no two whose lives meet overlap: in order of birth, the
    lowest gap between the storages still alive that holds it, else past them.
    -> (offsets, arena bytes). Offsets are multiples of ``ALIGNMENT``."""
    offsets: dict[int, int] = {}
    alive: list[tuple[int, int, int]] = []  # (offset, end, last call) by offset
    total = 0
    for storage in sorted(lives, key=lives.__getitem__):
        born, dies = lives[storage]
        alive = [span for span in alive if span[2] >= born]
        size = -(-sizes[storage] // ALIGNMENT) * ALIGNMENT
        offset = 0
        for start, end, _ in alive:
            if start - offset >= size:
                break
            offset = max(offset, end)
        offsets[storage] = offset
        bisect.insort(alive, (offset, offset + size, dies))
        total = max(total, offset + size)
    return offsets, total
