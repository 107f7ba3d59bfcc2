"""The engine: requests in, one scheduled forward per ``step()``, outputs out.

Requests arrive through intake (engine/input_processor.py), which has checked and
tokenized them; ``add`` only queues them.

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
import os
import weakref
from collections.abc import Sequence
from concurrent import futures
from dataclasses import replace

import torch

from updraft.c_builds import kernels_for, prebuild
from updraft.config import EngineConfig
from updraft.engine.families import Families, child_id
from updraft.engine.grammar_process import GrammarProcess
from updraft.engine.grammars import Grammars
from updraft.engine.input_processor import EngineRequest, InputProcessor, ModelLimits
from updraft.engine.kv_blocks import BlockPool, KVCacheManager
from updraft.engine.memory_report import EngineMemory, runner_memory
from updraft.engine.prefix_states import PrefixStates
from updraft.engine.scheduler import STRUCTURED_ERROR, Scheduler
from updraft.engine.state_slots import StateSlots
from updraft.engine.stats import EngineStats, StepClock, StructuredStats, snapshot_report
from updraft.engine.window_blocks import WindowBlocks
from updraft.engine.workers import (
    ParallelWorkers,
    Rendezvous,
    WorkerPool,
    run_rank,
    torchrun_group,
    torchrun_rendezvous,
)
from updraft.model_config import ModelConfig
from updraft.models.gguf_loader import check_gguf_split
from updraft.models.tensor_parallel import check_parallel
from updraft.outputs import RequestOutput
from updraft.parallel.topology import RankPlace
from updraft.request import FinishReason, Request
from updraft.runner.freed_memory import keep_freed_memory
from updraft.runner.runner import load_runner
from updraft.runner.threads import ThreadBudget
from updraft.sampling_params import SamplingParams
from updraft.speculative.registry import ProposerContext, check_method, make_proposer
from updraft.step.inputs import StepInputs
from updraft.step.plan import Draft, StepPlan
from updraft.tokenizer import Tokenizer

# While only constrained requests wait for their grammars, a step waits this long for
# one to compile before it returns (the caller's loop then looks at its own work).
COMPILE_POLL_SECONDS = 0.01


class Engine:
    def __init__(self, config: EngineConfig, worker_pool: WorkerPool | None = None) -> None:
        """``worker_pool``: where the other ranks of a split model run, instead of
        worker processes of this engine's own (engine/workers.py)."""
        check_method(config.speculative_method)  # before anything slow is loaded
        prebuild(kernels_for(config.model))
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
        check_gguf_split(self.model_config, config.model, config.parallel_sizes)
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
        hybrid = bool(self.model_config.linear_layers)
        # A hybrid model's prefix is resumed from the recurrent state stored at its last
        # block: without prefix states, its blocks are not shared.
        prefix_states = self._prefix_states() if hybrid else None
        pool = BlockPool(
            self._runner.num_blocks,
            config.positions_per_block,
            config.enable_prefix_caching and (prefix_states is not None or not hybrid),
            config.prefix_cache_evicts_first,
        )
        self._rotary = self._runner.rotary_switch
        # A sequence never holds more tokens than the cache can, so one request alone
        # always fits and preemption always makes progress.
        self.max_model_len = min(self.context_len, pool.num_blocks * pool.block_size)
        self.input_processor = InputProcessor(
            self.tokenizer,
            ModelLimits(
                config.model,
                self.max_model_len,
                self.model_config.vocab_size,
                tuple(self.model_config.eos_token_ids),
                self.context_len,
            ),
        )
        self._grammars = self._make_grammars(config)
        # Constrained requests whose grammar is still compiling: scheduled once it has.
        self._compiling: dict[str, tuple[Request, futures.Future]] = {}
        self._families = Families()  # requests with n > 1
        self._proposer = make_proposer(
            ProposerContext(config, self._runner, self.max_model_len, send)
        )
        self._scheduler = Scheduler(
            KVCacheManager(
                pool,
                # LongRoPE's long sequences are computed otherwise: cached apart.
                None if self._rotary is None else self._rotary.cache_salt,
                window=self._reading_window(),
                prefix_states=prefix_states,
                windowed=self._window_blocks(pool),
            ),
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            num_lookahead_tokens=k,
            grammars=self._grammars,
            long_context_from=None if self._rotary is None else self._rotary.original,
            state_slots=StateSlots(self._runner.num_state_slots) if hybrid else None,
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
        if config.keep_freed_memory and self._runner.device.type == "cpu":
            keep_freed_memory()  # now: what loading and capture freed goes back first

    def _prefix_states(self) -> PrefixStates | None:
        """A hybrid model's prefix states, in the slots after the running ones (None
        with prefix caching off, or no slot for them)."""
        runner = self._runner
        if not self.config.enable_prefix_caching or not runner.num_prefix_states:
            return None
        depth = runner.state_caches[0].shape[1]
        return PrefixStates(runner.num_state_slots, runner.num_prefix_states, depth)

    def _reading_window(self) -> int | None:
        """How far back any layer that reads the KV blocks looks, when every one has a
        sliding window: the target's, and the proposer's model's, which pages through
        the same block ids. None (nothing is given back) where any layer reads all."""
        configs = [self.model_config]
        if self._proposer is not None and self._proposer.runner is not None:
            configs.append(self._proposer.runner.model_config)
        windows = [config.widest_window for config in configs]
        return None if None in windows else max(windows)

    def _window_blocks(self, pool: BlockPool) -> WindowBlocks | None:
        """The windowed layers' own pool, where the runner keeps one: as many blocks as
        their caches hold, given back past the widest of their windows."""
        count = self._runner.num_window_blocks
        if not count:
            return None
        window = max(w for w in self.model_config.layer_windows if w is not None)
        windowed = BlockPool(count, pool.block_size, pool.enable_prefix_caching, pool.evicts_first)
        return WindowBlocks(windowed, window)

    def _make_grammars(self, config: EngineConfig) -> Grammars | None:
        """Structured outputs need the tokenizer: llguidance reads its vocabulary."""
        if self.tokenizer is None:
            return None
        process = GrammarProcess.for_model(
            config.model,
            self.model_config.vocab_size,
            self.tokenizer,
            self.model_config.eos_token_ids,
        )
        overlap = config.overlap_grammar_masks
        if overlap is None:
            spare_core = (os.cpu_count() or 1) > torch.get_num_threads()
            overlap = self._runner.device.type != "cpu" or spare_core
        # A hybrid model's recurrent state cannot take back a token a late mask drops.
        return Grammars(process, overlap=overlap, defer=not self.model_config.linear_layers)

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
                if runner.captured is not None:  # a worker still making graphs stops
                    runner.captured.close()
        if self._grammars is not None:
            self._grammars.close()

    def graphs_ready(self, wait: bool = False) -> bool:
        """Whether every model's graphs are captured (and compiled) and in use. Made in
        the background (``graphs_in_background``), they are taken in at each step and
        here; ``wait``: until they all are. The engine's own thread only."""
        runners = (self._runner, self._proposer and self._proposer.runner)
        captured = [runner.captured for runner in runners if runner is not None]
        return all(steps.ready(wait) for steps in captured if steps is not None)

    # -- requests ----------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        detokenize: bool = True,
    ) -> str:
        """Queue a request; returns its id. A prompt the engine cannot serve finishes at
        once with an error output instead of raising. With ``params.n > 1`` its n
        sequences come out under this id, each with its ``index`` (engine/families.py).
        ``detokenize`` False: the outputs carry tokens but no text, and stop strings are
        the caller's to find (a server's API process decodes, off the engine's GIL)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        return self.add(self.input_processor.process(prompt, params), request_id, detokenize)

    def add(
        self, intake: EngineRequest, request_id: str | None = None, detokenize: bool = True
    ) -> str:
        """Queue a request that has been through intake (engine/input_processor.py), as
        ``add_request`` does; the server's API processes make them."""
        params = intake.params
        request_id = str(next(self._ids)) if request_id is None else request_id
        if self._in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n == 1:
            self._add_sequence(intake, params, request_id, detokenize=detokenize)
            return request_id
        ids = [child_id(request_id, index) for index in range(params.n)]
        if any(self._in_use(i) for i in ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        self._families.add(request_id, ids)
        # Held until the first has prefilled, so they find its blocks in the prefix cache.
        hold = self.config.enable_prefix_caching and params.structured_outputs is None
        for index, sequence_id in enumerate(ids):
            seed = None if params.seed is None else (params.seed + index) % 2**64
            sequence = replace(params, n=1, seed=seed)
            held = self._add_sequence(
                intake, sequence, sequence_id, hold=hold and index > 0, detokenize=detokenize
            )
            if held is not None:
                self._families.hold(request_id, held)
        return request_id

    def _in_use(self, request_id: str) -> bool:
        return (
            request_id in self._scheduler.requests
            or request_id in self._compiling
            or request_id in self._families
        )

    def _add_sequence(
        self,
        intake: EngineRequest,
        params: SamplingParams,
        request_id: str,
        hold: bool = False,
        detokenize: bool = True,
    ) -> Request | None:
        """Make and queue one sequence's request; with ``hold``, return it instead of
        scheduling it (when it is servable)."""
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        tokenizer = self.tokenizer if detokenize else None
        request = intake.build(request_id, params, tokenizer, eos)
        spec = params.structured_outputs
        if intake.error is not None:
            request.error = intake.error
            self._pending_outputs.append(self._scheduler.finish(request, FinishReason.ERROR))
        elif spec is not None:
            self._compiling[request_id] = (request, self._grammars.compile(spec))
        elif hold:
            return request
        else:
            self._scheduler.add(request)
        return None

    def _admit(self) -> list[RequestOutput]:
        """Before a step: the outputs of requests that ended outside one (refused,
        aborted, a grammar that did not compile), and the scheduler given what may now
        run (compiled grammars, a family's held sequences once the first has prefilled)."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if self._grammars is not None:
            outputs += self._end_by_grammar()
        if self._compiling:
            outputs += self._admit_compiled(wait=not self._scheduler.has_unfinished)
        for request in self._families.released(self._scheduler.requests):
            self._scheduler.add(request)
        return outputs

    def _end_by_grammar(self) -> list[RequestOutput]:
        """End the requests whose grammar is complete or broken, or whose late mask
        failed or took too long (engine/grammars.py)."""
        outputs = []
        for request_id, reason, error in self._grammars.settle():
            request = self._scheduler.requests.get(request_id)
            if request is None:
                continue
            if error is not None:
                request.error = f"{STRUCTURED_ERROR}{error}"
            output = self._scheduler.finish(request, reason)
            if output is not None:
                outputs.append(output)
        return outputs

    def _admit_compiled(self, wait: bool) -> list[RequestOutput]:
        """Schedule the constrained requests whose grammar has compiled (with ``wait``,
        after waiting a moment for one when nothing else would run); a spec that did not
        compile ends its request with the compiler's message."""
        if wait and self._compiling:
            pending = [future for _, future in self._compiling.values()]
            self._grammars.wait_compiled(pending, COMPILE_POLL_SECONDS)
        outputs = []
        for request_id, (request, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                handle = future.result()
            except Exception as error:  # a spec the compiler refused, or failed on
                request.error = str(error) if isinstance(error, ValueError) else repr(error)
                outputs.append(self._scheduler.finish(request, FinishReason.ERROR))
                continue
            spec = request.sampling_params.structured_outputs
            self._grammars.start(request_id, handle, spec.starts_after)
            self._scheduler.add(request)
        return outputs

    def abort(self, request_id: str) -> bool:
        if request_id in self._families:
            for request in self._families.take_held(request_id):
                self._pending_outputs.append(self._scheduler.finish(request, FinishReason.ABORT))
            aborted = [self.abort(child) for child in self._families.children(request_id)]
            return any(aborted)
        if request_id in self._compiling:
            request, future = self._compiling.pop(request_id)
            future.cancel()
            self._pending_outputs.append(self._scheduler.finish(request, FinishReason.ABORT))
            return True
        request = self._scheduler.requests.get(request_id)
        if request is None:
            return False
        self._pending_outputs.append(self._scheduler.finish(request, FinishReason.ABORT))
        return True

    @property
    def has_unfinished(self) -> bool:
        return (
            self._scheduler.has_unfinished
            or bool(self._pending_outputs)
            or bool(self._compiling)
            or bool(self._families.num_held)
        )

    # -- stepping ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of every request with news since the last call."""
        outputs = self._admit()
        clock = self._clock.start()
        plan = self._scheduler.schedule(self._drafts)
        clock.lap("schedule")
        if not plan.scheduled:
            return self._idle(outputs)
        self._threads.adjust()
        inputs = self._inputs(plan)
        clock.lap("build")
        allowed = self._grammars.masks(inputs) if self._grammars else None
        result = self._runner.execute(inputs, allowed)  # the masks are made while it runs
        clock.lap("sample", forward_seconds=result.forward_seconds)
        outputs += self._scheduler.update(plan, result)
        clock.lap("update")
        if self._proposer is not None:
            self._drafts = self._proposer.propose(inputs, result, self._scheduler.drafting())
            clock.lap("propose")
        return self._families.relabel(outputs)

    def _idle(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """A step with nothing to run: every request may be waiting for its mask."""
        if self._grammars is not None:
            self._grammars.wait_late(COMPILE_POLL_SECONDS)
        return self._families.relabel(outputs)

    def _inputs(self, plan: StepPlan) -> StepInputs:
        return StepInputs.build(
            plan, self.config.positions_per_block, self._wants_hidden_states, self._rotary
        )

    def memory(self) -> EngineMemory:
        """The target runner's tensors by part (weights, KV, graphs), for a memory report
        (``engine/memory_report.py``)."""
        return runner_memory(self._runner, self._scheduler.kv.pool.num_used, self.config.model)

    def stats(self) -> EngineStats:
        """A snapshot: queue lengths, KV blocks, how steps ran, speculative acceptance."""
        scheduler = self._scheduler
        pool, slots, prefix = scheduler.kv.pool, scheduler.state_slots, scheduler.kv.prefix_states
        windowed = None if scheduler.kv.windowed is None else scheduler.kv.windowed.pool
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
            structured=None
            if self._grammars is None
            else StructuredStats(
                num_constrained=len(self._grammars),
                num_compiling=len(self._compiling),
                masked_rows=self._grammars.num_masked_rows,
                late_masks=self._grammars.num_late_masks,
                costly_masks=self._grammars.process.num_slow_masks,
                speculative=scheduler.constrained_speculative.copy(),
            ),
            state_slots_used=0 if slots is None else slots.num_slots - slots.num_free,
            state_slots_total=0 if slots is None else slots.num_slots,
            prefix_states=None if prefix is None else prefix.stats(),
            window_blocks_used=0 if windowed is None else windowed.num_used,
            window_blocks_total=0 if windowed is None else windowed.num_blocks,
        )
