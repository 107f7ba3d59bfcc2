"""The runner probe: a record of every step every runner runs, on every rank.

Tests (and anyone debugging a replay) see what a graph actually read through it, worker
processes included, without reaching into the engine. ``EngineConfig.probe`` names a
directory; each process appends its records to ``rank<R>.records`` there, and
``read_probe(directory)`` hands them back once the engine is closed (a worker writes
its last record when its rank ends, ``Engine.close()`` waits for that).

Records, each naming the runner (``target``, ``draft``, ``head``) and the rank:

* ``StepRecord``, per forward: how it ran (``graph`` or ``eager (why)``), its bucket, the
  step's request ids, sizes and tensors as the runner was handed them (a split
  prefill's global ones), and for a replay the graph's mode (``FULL``: one graph
  with attention inside; ``PIECEWISE``: tasks between segments) and every declared
  input's buffer: its data pointer and its contents after the refresh, which is what
  the graph read.
* ``SampledRecord``, per step that sampled (rank 0): each request's logits rows, one per
  token it emitted (a verify step's first rows), as the sampler saw them.
* ``CacheRecord``, at close: the runner's KV caches (up to ``MAX_CACHE_BYTES`` of them).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class StepRecord:
    runner: str
    rank: int
    mode: str
    bucket: tuple | None
    request_ids: list[str]
    num_tokens: int
    num_reqs: int
    graph_mode: str | None = None  # replays only: "FULL" or "PIECEWISE"
    pointers: dict[str, int] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    # The step as the runner was handed it (every forward): its tensors by field name.
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class SampledRecord:
    runner: str
    rank: int
    logits: dict[str, torch.Tensor]  # request id -> [tokens it emitted, vocab]


@dataclass(frozen=True)
class CacheRecord:
    runner: str
    rank: int
    kv_caches: list[torch.Tensor]


# The most KV cache bytes a probe copies at close: tests probe small caches.
MAX_CACHE_BYTES = 64 * 2**20


class Probe:
    """Where one runner writes its records."""

    def __init__(self, directory: str | Path, runner: str, rank: int) -> None:
        self.path = Path(directory) / f"rank{rank}.records"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.runner = runner
        self.rank = rank

    def _write(self, record: StepRecord | SampledRecord | CacheRecord) -> None:
        with self.path.open("ab") as file:
            pickle.dump(record, file)

    def step(
        self, mode: str, request_ids: list[str], step: Any, replayed: tuple[tuple, Any] | None
    ) -> None:
        """A forward of ``step`` (its sizes recorded), and with ``replayed``, the bucket
        and the captured graph it replayed (whose buffers the refresh just filled)."""
        bucket, captured = replayed or (None, None)
        inputs = {} if captured is None else captured.inputs
        self._write(
            StepRecord(
                self.runner,
                self.rank,
                mode,
                None if bucket is None else tuple(bucket),
                list(request_ids),
                step.num_tokens,
                step.num_reqs,
                None if captured is None else captured.graph.backend.mode,
                {name: i.buffer.data_ptr() for name, i in inputs.items()},
                {name: i.buffer.detach().cpu().clone() for name, i in inputs.items()},
                {
                    f.name: value.detach().cpu().clone()
                    for f in fields(step)
                    if isinstance(value := getattr(step, f.name), torch.Tensor)
                },
            )
        )

    def sampled(
        self, request_ids: list[str], logits: torch.Tensor, rows_per_request: list[int],
        emitted: list[list[int]],
    ) -> None:  # fmt: skip
        """``logits``: the rows the step sampled or verified from, ``rows_per_request``
        of them per request in order; each request keeps one per token it emitted."""
        kept, first = {}, 0
        for request_id, rows, tokens in zip(request_ids, rows_per_request, emitted, strict=True):
            kept[request_id] = logits[first : first + len(tokens)].detach().cpu().clone()
            first += rows
        self._write(SampledRecord(self.runner, self.rank, kept))

    def closed(self, kv_caches: list[torch.Tensor]) -> None:
        """Record the caches, unless they are larger than a probe keeps (a copy of a
        gigabyte budget per run would cost more than the run)."""
        if sum(cache.numel() * cache.element_size() for cache in kv_caches) <= MAX_CACHE_BYTES:
            copies = [cache.detach().cpu().clone() for cache in kv_caches]
            self._write(CacheRecord(self.runner, self.rank, copies))


@dataclass
class ProbeRecords:
    steps: list[StepRecord]
    sampled: list[SampledRecord]
    caches: list[CacheRecord]

    def steps_of(self, runner: str = "target", rank: int = 0) -> list[StepRecord]:
        return [s for s in self.steps if s.runner == runner and s.rank == rank]

    def replays(self, runner: str = "target", rank: int = 0) -> list[StepRecord]:
        return [s for s in self.steps_of(runner, rank) if s.mode == "graph"]

    def logits_of(self, request_id: str, count: int | None = None) -> torch.Tensor:
        """[tokens, vocab]: the target's logits row each of the request's emitted tokens
        was drawn from, in order (the first ``count``: tokens dropped after a stop are
        left out)."""
        rows = [r.logits[request_id] for r in self.sampled if request_id in r.logits]
        assert rows, f"request {request_id} sampled nothing"
        every = torch.cat(rows)
        if count is not None:
            assert every.shape[0] >= count, "a token was emitted without its logits seen"
            every = every[:count]
        return every

    def kv_caches(self, runner: str = "target", rank: int = 0) -> list[torch.Tensor]:
        """The runner's KV caches when the engine closed (one small enough to keep)."""
        (record,) = [c for c in self.caches if c.runner == runner and c.rank == rank]
        return record.kv_caches


def read_probe(directory: str | Path) -> ProbeRecords:
    """Every record of every rank in ``directory``, in the order each rank wrote them."""
    records: list = []
    for path in sorted(Path(directory).glob("rank*.records")):
        records.extend(_records(path))
    return ProbeRecords(
        [r for r in records if isinstance(r, StepRecord)],
        [r for r in records if isinstance(r, SampledRecord)],
        [r for r in records if isinstance(r, CacheRecord)],
    )


def _records(path: Path) -> Iterator[StepRecord | SampledRecord | CacheRecord]:
    with path.open("rb") as file:
        while True:
            try:
                yield pickle.load(file)
            except EOFError:
                return
