"""The other ranks of a parallel engine: worker processes it starts itself, or the
processes ``torchrun`` started beside it.

Rank 0 is the engine's own process: it schedules, samples and proposes. Ranks 1..W-1
each load their shard into a ``Runner`` of their own (and a draft head's beside it,
when the proposer has one) and then run, message after message, the forward rank 0
announces before it runs it (``runner/rank_messages.py``, over
``parallel/collectives.py``), the same step in the same way (graph bucket or eager), so
that the collectives inside it pair up.
A step that splits no prefill runs whole on every prefill-context rank: each rank's
cache then holds every position, whichever later step reads it. Their logits are
discarded: rank 0's are the same.

Workers are started with ``spawn`` (a fresh interpreter: no copy of the parent's
threads or locks), as daemons, so they never outlive the engine; ``close`` stops them.
Each takes an equal share of the machine's cores. Under ``torchrun`` (``RANK`` and
``WORLD_SIZE`` set) every rank runs the user's program: rank 0's engine is the engine,
and on every other rank constructing the engine runs that rank's steps until rank 0
closes, then exits the process.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import os
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection

import torch

from updraft.config import EngineConfig
from updraft.model_config import ModelConfig
from updraft.parallel import collectives
from updraft.parallel.topology import RankPlace, rank_device, uses_nccl
from updraft.runner.follower import Follower
from updraft.runner.freed_memory import keep_freed_memory
from updraft.runner.rank_messages import RankMessage
from updraft.runner.runner import load_runner
from updraft.speculative.registry import ProposerContext, rank_runners

STOP = None  # what rank 0 broadcasts instead of a step when the engine closes


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def share_cores(ranks: int) -> None:
    """One process's share of the cores: torch's threads and the kernels' OpenMP."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))


@dataclass(frozen=True)
class Rendezvous:
    """Where a group's ranks meet: a TCP store, and whether they share one machine."""

    port: int
    host: str = "127.0.0.1"
    store_hosted: bool = False  # by a launcher (torchrun's agent), not by rank 0
    one_machine: bool = True


def torchrun_rendezvous() -> tuple[int, int, Rendezvous] | None:
    """(rank, world size, rendezvous) when torchrun started this process as one of
    several, else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2 or "RANK" not in os.environ:
        return None
    meeting = Rendezvous(
        port=int(os.environ["MASTER_PORT"]),
        host=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        store_hosted=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        one_machine=int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world,
    )
    return int(os.environ["RANK"]), world, meeting


def run_rank(
    place: RankPlace,
    meeting: Rendezvous,
    config: EngineConfig,
    model_config: ModelConfig,
    max_model_len: int,
    query_lens: tuple[int, ...],
) -> None:
    """The rank at ``place`` (not 0): load its shard, then run every step rank 0
    broadcasts until it broadcasts STOP."""
    share_cores(place.sizes.world)
    connect(place, meeting, config)
    runner = load_runner(model_config, config, max_model_len, query_lens=query_lens, place=place)
    # As rank 0's engine bounds a sequence: by the context and by the cache.
    capacity = min(max_model_len, runner.num_blocks * config.positions_per_block)
    runners = [runner, *rank_runners(ProposerContext(config, runner, capacity))]
    if config.keep_freed_memory and runner.device.type == "cpu":
        keep_freed_memory()
    follower = Follower(runners)
    while (message := collectives.broadcast_object(place.name)) is not STOP:
        follower.run(message)
    for each in runners:
        each.close()
    collectives.forget(place)


def connect(place: RankPlace, meeting: Rendezvous, config: EngineConfig) -> None:
    """Join the rank's groups; on CUDA, first make its own GPU the current device."""
    device = rank_device(config.device, place.rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    ranks_here = place.sizes.world if meeting.one_machine else torch.cuda.device_count()
    nccl = uses_nccl(config.device, ranks_here)
    collectives.connect(place, **asdict(meeting), nccl=nccl)


def torchrun_group(meeting: Rendezvous) -> str:
    """The world group's name under torchrun: the same on every rank."""
    return f"updraft-{meeting.host}-{meeting.port}"


def serve_ranks(connection: Connection, initializer: Callable[[], None] | None = None) -> None:
    """A pool worker: run ``initializer`` once, then each rank it is sent (``run_rank``'s
    arguments) to its end, report back, and wait for the next, until it is sent None."""
    if initializer is not None:
        initializer()
    while (job := connection.recv()) is not None:
        try:
            run_rank(*job)
        finally:
            connection.send("done")


@dataclass
class PoolWorker:
    process: multiprocessing.process.BaseProcess
    connection: Connection
    busy: bool = False


class WorkerPool:
    """Worker processes that serve one engine's ranks after another's: engines made
    one after another in a program (a test module) skip starting interpreters and
    importing torch for each. A worker is free again once its engine has closed;
    ``take`` starts more when too few are. Pass it as ``LLM(..., worker_pool=pool)``.
    ``initializer`` (picklable) runs first in each worker process, as in
    ``multiprocessing.Pool``."""

    def __init__(self, initializer: Callable[[], None] | None = None) -> None:
        self.workers: list[PoolWorker] = []
        self.initializer = initializer

    def take(self, count: int) -> list[PoolWorker]:
        for worker in self.workers:
            self.release(worker, wait_seconds=0)
        self.workers = [w for w in self.workers if w.process.is_alive()]  # the rest died
        free = [w for w in self.workers if not w.busy]
        context = multiprocessing.get_context("spawn")
        while len(free) < count:
            ours, theirs = context.Pipe()
            process = context.Process(
                target=serve_ranks,
                args=(theirs, self.initializer),
                name=f"updraft-pool-worker-{len(self.workers)}",
                daemon=True,
            )
            process.start()
            free.append(PoolWorker(process, ours))
            self.workers.append(free[-1])
        for worker in free[:count]:
            worker.busy = True
        return free[:count]

    @staticmethod
    def release(worker: PoolWorker, wait_seconds: float) -> None:
        """Mark ``worker`` free once it reports its rank done (waiting up to
        ``wait_seconds`` for that)."""
        if worker.busy and worker.connection.poll(wait_seconds):
            try:
                worker.connection.recv()
            except EOFError:  # it died: ``take`` drops it
                return
            worker.busy = False

    def close(self) -> None:
        for worker in self.workers:
            if worker.process.is_alive():
                worker.connection.send(None)
        for worker in self.workers:
            worker.process.join(timeout=10)
            if worker.process.is_alive():
                worker.process.kill()
        self.workers = []


class ParallelWorkers:
    """Ranks 1..W-1 as seen from rank 0; ``place`` is rank 0's, for its own Runner.
    ``meeting``: the ranks are torchrun's, already started; without it, rank 0 starts
    them here, or has ``pool``'s workers run them."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        query_lens: tuple[int, ...],
        meeting: Rendezvous | None = None,
        pool: WorkerPool | None = None,
    ) -> None:
        sizes = config.parallel_sizes
        self.processes = []
        self.pool_workers: list[PoolWorker] = []
        if meeting is None:
            meeting = Rendezvous(port=_free_port())
            group = f"updraft-{os.getpid()}-{meeting.port}"
            rest = (meeting, config, model_config, max_model_len, query_lens)
            jobs = [(RankPlace(r, sizes, group), *rest) for r in range(1, sizes.world)]
            if pool is not None:
                self.pool_workers = pool.take(len(jobs))
                for worker, job in zip(self.pool_workers, jobs, strict=True):
                    worker.connection.send(job)
                    self.processes.append(worker.process)
            else:
                context = multiprocessing.get_context("spawn")
                for job in jobs:
                    process = context.Process(
                        target=run_rank, args=job, name=f"updraft-rank-{job[0].rank}", daemon=True
                    )
                    process.start()
                    self.processes.append(process)
        else:
            group = torchrun_group(meeting)
        share_cores(sizes.world)
        self.place = RankPlace(0, sizes, group)
        connect(self.place, meeting, config)
        self.closed = False
        self.messages: Counter[str] = Counter()  # sent, by kind

    def send(self, message: RankMessage) -> None:
        """Have every worker run what rank 0 is about to (``rank_messages.py``)."""
        self._check_alive()
        self.messages[type(message).__name__] += 1
        collectives.broadcast_object(self.place.name, message)

    def _check_alive(self) -> None:
        dead = [p.name for p in self.processes if not p.is_alive()]
        if dead:
            raise RuntimeError(f"parallel worker {', '.join(dead)} exited")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if all(p.is_alive() for p in self.processes):
            collectives.broadcast_object(self.place.name, STOP)
        if self.pool_workers:  # they go back to the pool once their ranks have ended
            for worker in self.pool_workers:
                WorkerPool.release(worker, wait_seconds=10)
            collectives.forget(self.place)
            return
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        collectives.forget(self.place)
