"""The other ranks of a tensor-parallel engine, as worker processes it starts itself.

Rank 0 is the engine's own process: it schedules, samples and proposes. Ranks 1..T-1
each load their shard into a ``Runner`` of their own and then run, step after step, the
forward of the ``StepInputs`` rank 0 broadcasts (``parallel/collectives.py``), the same
step in the same way (graph bucket or eager), so that the collectives inside it pair up.
Their logits are discarded: rank 0's are the same, gathered over every rank.

Workers are started with ``spawn`` (a fresh interpreter: no copy of the parent's
threads or locks), as daemons, so they never outlive the engine; ``close`` stops them.
Each takes an equal share of the machine's cores.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from dataclasses import replace

import torch

from updraft.config import EngineConfig, ModelConfig
from updraft.models.tensor_parallel import TensorRank
from updraft.parallel import collectives
from updraft.runner.runner import Runner
from updraft.step.inputs import StepInputs
from updraft.step.sampling_batch import SamplingBatch

STOP = None  # what rank 0 broadcasts instead of a step when the engine closes


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def share_cores(ranks: int) -> None:
    """One process's share of the cores: torch's threads and the kernels' OpenMP."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))


def _run_rank(
    rank: TensorRank,
    port: int,
    config: EngineConfig,
    model_config: ModelConfig,
    max_model_len: int,
    query_lens: tuple[int, ...],
) -> None:
    share_cores(rank.size)
    collectives.connect(rank.group, rank.rank, rank.size, port)
    runner = Runner(model_config, config, max_model_len, query_lens, tensor_rank=rank)
    while (inputs := collectives.broadcast_object(rank.group)) is not STOP:
        runner.forward(inputs)


def forward_only(inputs: StepInputs) -> StepInputs:
    """What a worker needs of a step: its forward's inputs, not the requests' sampling
    state (their random generators stay on rank 0)."""
    return replace(inputs, sampling=SamplingBatch([], []), draft_probs=[])


class TensorParallelWorkers:
    """Ranks 1..size-1; ``rank`` is rank 0's place in the group, for its own Runner."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        query_lens: tuple[int, ...],
    ) -> None:
        size = config.tensor_parallel_size
        port = _free_port()
        group = f"updraft-tp-{os.getpid()}-{port}"
        context = multiprocessing.get_context("spawn")
        self.processes = [
            context.Process(
                target=_run_rank,
                args=(
                    TensorRank(r, size, group),
                    port,
                    config,
                    model_config,
                    max_model_len,
                    query_lens,
                ),
                name=f"updraft-rank-{r}",
                daemon=True,
            )
            for r in range(1, size)
        ]
        for process in self.processes:
            process.start()
        share_cores(size)
        self.rank = TensorRank(0, size, group)
        collectives.connect(group, 0, size, port)
        self.closed = False

    def run(self, inputs: StepInputs) -> None:
        """Have every worker run ``inputs``' forward, as rank 0 is about to."""
        self._check_alive()
        collectives.broadcast_object(self.rank.group, forward_only(inputs))

    def _check_alive(self) -> None:
        dead = [p.name for p in self.processes if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel worker {', '.join(dead)} exited")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if all(p.is_alive() for p in self.processes):
            collectives.broadcast_object(self.rank.group, STOP)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        collectives.forget(self.rank.group)
