"""The engine: requests in, one scheduled forward per ``step()``, outputs out.

One step is schedule -> build -> execute -> update -> propose:

* ``Scheduler.schedule(drafts)`` plans the step (``StepPlan``), verifying the drafts the
  proposer made after the previous step;
* ``StepInputs.build(plan)`` makes the forward's inputs;
* ``Runner.execute(inputs)`` runs it and returns one ``StepOutput``;
* ``Scheduler.update(plan, output)`` ends the step and returns the outputs;
* the proposer, if any, drafts for the next step from this one.

Single-threaded and synchronous; the offline ``LLM`` and the server drive it by calling
``step()`` in a loop. Bad requests finish with ``FinishReason.ERROR`` and a message;
they never stop other requests or leave blocks behind.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Sequence
from dataclasses import replace

from updraft.config import EngineConfig, ModelConfig
from updraft.engine.kv_blocks import BlockPool, KVCacheManager
from updraft.engine.scheduler import Scheduler
from updraft.engine.stats import EngineStats, StepClock, snapshot_report
from updraft.engine.workers import (
    ParallelWorkers,
    Rendezvous,
    WorkerPool,
    run_rank,
    torchrun_group,
    torchrun_rendezvous,
)
from updraft.models.tensor_parallel import check_parallel
from updraft.outputs import RequestOutput
from updraft.parallel.topology import RankPlace
from updraft.request import FinishReason, Request
from updraft.runner.runner import load_runner
from updraft.runner.threads import ThreadBudget
from updraft.sampling_params import SamplingParams
from updraft.speculative.registry import ProposerContext, check_method, make_proposer
from updraft.step.inputs import StepInputs
from updraft.step.plan import Draft
from updraft.tokenizer import Detokenizer, Tokenizer


class Engine:
    def __init__(self, config: EngineConfig, worker_pool: WorkerPool | None = None) -> None:
        """``worker_pool``: where the other ranks of a split model run, instead of
        worker processes of this engine's own (engine/workers.py)."""
        check_method(config.speculative_method)  # before anything slow is loaded
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.context_len = self._context_len(config)
        k = config.num_speculative_tokens if config.speculative_method else 0
        query_lens = (1, 1 + k) if k else (1,)  # decode and verify steps, for graphs
        launched = torchrun_rendezvous()
        if launched is not None:
            config = self.config = self._join_torchrun(config, *launched, query_lens)
        check_parallel(
            self.model_config, config.parallel_sizes, config.weight_format(self.model_config)
        )
        # The other ranks of a split model: started first, since every rank captures
        # its steps together (the collectives inside them pair up).
        self._workers = None
        place = None
        if config.parallel_sizes.world > 1:
            self._workers = ParallelWorkers(
                config,
                self.model_config,
                self.context_len,
                query_lens,
                meeting=None if launched is None else launched[2],
                pool=worker_pool,
            )
            place = self._workers.place
            weakref.finalize(self, self._workers.close)
        send = None if self._workers is None else self._workers.send
        self._runner = load_runner(
            self.model_config,
            config,
            self.context_len,
            query_lens=query_lens,
            place=place,
            send=send,
        )
        pool = BlockPool(
            self._runner.num_blocks, config.positions_per_block, config.enable_prefix_caching
        )
        # A sequence never holds more tokens than the cache can, so one request alone
        # always fits and preemption always makes progress.
        self.max_model_len = min(self.context_len, pool.num_blocks * pool.block_size)
        self._scheduler = Scheduler(
            KVCacheManager(pool),
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            num_lookahead_tokens=k,
        )
        self._proposer = make_proposer(
            ProposerContext(config, self._runner, self.max_model_len, send)
        )
        self._wants_hidden_states = bool(self._proposer and self._proposer.wants_hidden_states)
        self._drafts: dict[str, Draft] = {}  # proposed after a step, verified by the next
        self._pending_outputs: list[RequestOutput] = []
        self._clock = StepClock()
        self._threads = ThreadBudget(
            enabled=config.adaptive_threads
            and self._runner.device.type == "cpu"
            and self._workers is None  # each rank keeps its share of the cores
        )
        self._ids = itertools.count()

    def _context_len(self, config: EngineConfig) -> int:
        """The longest sequence: ``max_model_len``, or the positions the model was
        trained for, which ``max_model_len`` may not exceed."""
        trained = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > trained:
            raise ValueError(
                f"max_model_len {config.max_model_len} is above the {trained} positions "
                f"{config.model} was trained for (max_position_embeddings in its config.json)"
            )
        return config.max_model_len or trained

    def _join_torchrun(
        self,
        config: EngineConfig,
        rank: int,
        world: int,
        meeting: Rendezvous,
        query_lens: tuple[int, ...],
    ) -> EngineConfig:
        """Under torchrun every rank builds the engine: rank 0 goes on as the engine
        over ``world`` ranks (all tensor-parallel, unless the sizes say otherwise); any
        other rank runs its steps here and then exits."""
        if config.parallel_sizes.world == 1:
            config = replace(config, tensor_parallel_size=world)
        if config.parallel_sizes.world != world:
            raise ValueError(
                f"tensor_parallel_size {config.tensor_parallel_size} x "
                f"prefill_context_parallel_size {config.prefill_context_parallel_size} "
                f"does not match the {world} processes torchrun started (WORLD_SIZE)"
            )
        if rank == 0:
            return config
        check_parallel(
            self.model_config, config.parallel_sizes, config.weight_format(self.model_config)
        )
        place = RankPlace(rank, config.parallel_sizes, torchrun_group(meeting))
        run_rank(place, meeting, config, self.model_config, self.context_len, query_lens)
        raise SystemExit(0)

    def close(self) -> None:
        """Stop the other ranks (a pool's workers go back to the pool), once they have
        ended theirs; a probe's records are then complete. Also done when the engine is
        collected; calling it first frees them at a known point."""
        if self._workers is not None:
            self._workers.close()
        for runner in (self._runner, self._proposer and self._proposer.runner):
            if runner is not None:
                runner.close()

    # -- requests ----------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; returns its id. A prompt the engine cannot serve finishes at
        once with an error output instead of raising."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        if text is None and len(prompt) >= self.max_model_len:
            # Refused at the cost of len(), before a look at each of a huge list's ids.
            token_ids, error = [], self._check_length(len(prompt))
        else:
            token_ids, error = self._prompt_token_ids(prompt)
            error = error or self._check_length(len(token_ids))
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        detokenizer = Detokenizer(self.tokenizer, token_ids, params.stop)
        request = Request(
            request_id, text, token_ids, params, eos, time.perf_counter(), detokenizer
        )
        if error is not None:
            request.error = error
            self._pending_outputs.append(self._scheduler.finish(request, FinishReason.ERROR))
        else:
            self._scheduler.add(request)
        return request_id

    def _prompt_token_ids(self, prompt: str | Sequence[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return [], f"{self.config.model} has no tokenizer.json; pass token ids"
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as error:
                return [], f"prompt has a lone surrogate at character {error.start}: not text"
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                return [], f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
        if not token_ids:
            return [], "prompt is empty"
        return token_ids, None

    def _check_length(self, num_prompt_tokens: int) -> str | None:
        if num_prompt_tokens < self.max_model_len:
            return None
        limit = (
            f"the model's context length {self.context_len}"
            if self.max_model_len == self.context_len
            else f"the KV cache's capacity of {self.max_model_len} tokens"
        )
        return f"prompt of {num_prompt_tokens} tokens leaves no room to generate within {limit}"

    def abort(self, request_id: str) -> bool:
        request = self._scheduler.requests.get(request_id)
        if request is None:
            return False
        self._pending_outputs.append(self._scheduler.finish(request, FinishReason.ABORT))
        return True

    @property
    def has_unfinished(self) -> bool:
        return self._scheduler.has_unfinished or bool(self._pending_outputs)

    # -- stepping ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that produced text or
        finished since the last call."""
        outputs, self._pending_outputs = self._pending_outputs, []
        clock = self._clock.start()
        plan = self._scheduler.schedule(self._drafts)
        clock.lap("schedule")
        if not plan.scheduled:
            return outputs
        self._threads.adjust()
        inputs = StepInputs.build(plan, self.config.positions_per_block, self._wants_hidden_states)
        clock.lap("build")
        result = self._runner.execute(inputs)
        clock.lap("sample", forward_seconds=result.forward_seconds)
        outputs += self._scheduler.update(plan, result)
        clock.lap("update")
        if self._proposer is not None:
            self._drafts = self._proposer.propose(inputs, result, self._scheduler.drafting())
            clock.lap("propose")
        return outputs

    def stats(self) -> EngineStats:
        """A snapshot: queue lengths, KV blocks, how steps ran, speculative acceptance."""
        scheduler = self._scheduler
        pool = scheduler.kv.pool
        draft_runner = None if self._proposer is None else self._proposer.runner
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_blocks_used=pool.num_used,
            kv_blocks_total=pool.num_blocks,
            steps=dict(self._runner.step_modes),
            threads=self._threads.threads,
            draft_steps=None if draft_runner is None else dict(draft_runner.step_modes),
            speculative=None if self._proposer is None else scheduler.speculative.copy(),
            sanitize=snapshot_report(self._runner.sanitize_report),
            draft_sanitize=None
            if draft_runner is None
            else snapshot_report(draft_runner.sanitize_report),
            positions_per_block=self.config.positions_per_block,
            num_steps=self._runner.step_modes.total(),
            phase_seconds=dict(self._clock.seconds),
            rank_messages=None if self._workers is None else dict(self._workers.messages),
        )
