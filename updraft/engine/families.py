"""Requests with ``n > 1``: one prompt, n sequences, one request id for the caller.

Each sequence runs as a request of its own (``<id>#<index>``), with ``seed + index``
when seeded, as vLLM does. The first one runs alone until its prompt is prefilled; the
others are held until then, so they find the prompt's full blocks in the prefix cache
and share them instead of computing and storing the prompt n times.

Outputs go out under the caller's id, each with its sequence's ``index``; the request
is ``finished`` with the last of its sequences. ``merge_outputs`` (in ``outputs.py``)
turns them into one output with n completions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from updraft.outputs import RequestOutput
from updraft.request import Request


def child_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


@dataclass
class _Family:
    child_ids: list[str]
    unfinished: set[str]
    held: list[Request] = field(default_factory=list)  # waiting for the first's prefill


class Families:
    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}
        self._parent: dict[str, tuple[str, int]] = {}  # child id -> (caller's id, index)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._families

    def add(self, request_id: str, ids: list[str]) -> None:
        """A new family: ``request_id``'s sequences, ``child_id`` of each index."""
        self._families[request_id] = _Family(ids, set(ids))
        for index, child in enumerate(ids):
            self._parent[child] = (request_id, index)

    def hold(self, request_id: str, request: Request) -> None:
        self._families[request_id].held.append(request)

    def children(self, request_id: str) -> list[str]:
        return list(self._families[request_id].child_ids)

    @property
    def num_held(self) -> int:
        return sum(len(family.held) for family in self._families.values())

    def released(self, requests: dict[str, Request]) -> list[Request]:
        """Held sequences whose first sibling has prefilled its prompt (or ended, or is
        gone), in the order they were held; they leave the family's hold."""
        out = []
        for family in self._families.values():
            if not family.held:
                continue
            first = requests.get(family.child_ids[0])
            if first is None or first.finished or first.first_token_time is not None:
                out += family.held
                family.held = []
        return out

    def take_held(self, request_id: str) -> list[Request]:
        """The held sequences of a family (aborted before they ran)."""
        family = self._families[request_id]
        held, family.held = family.held, []
        return held

    def relabel(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Sequences' outputs under the caller's id with their index; a family ends
        with its last sequence."""
        for output in outputs:
            parent = self._parent.get(output.request_id)
            if parent is None:
                continue
            request_id, index = parent
            family = self._families[request_id]
            if output.finished:
                family.unfinished.discard(output.request_id)
                self._parent.pop(output.request_id)
            output.request_id = request_id
            output.outputs[0].index = index
            output.finished = not family.unfinished
            if output.finished:
                del self._families[request_id]
        return outputs
