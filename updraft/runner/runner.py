"""The model runner: the one step driver of every model that runs a step.

The target, a draft model and a draft head (EAGLE, MTP) each have a ``Runner``: it owns
the model's KV cache and its captured buckets, and runs one step at a time. ``forward``
is the one way a model runs: a graph replay when the step fits a captured bucket, else
eager, counted in ``step_modes`` either way. ``execute`` is a target's step: the
forward, then the tokens (requests that carry drafts are verified by the rejection
sampler, the others sampled), all in one ``StepOutput``. A draft head's runner also
replays its greedy draft loop (``draft_loop``), one more kind of bucket.
"""

from __future__ import annotations

import time
from collections import Counter
from functools import cached_property
from typing import NamedTuple

import torch
from torch import nn

from updraft.attention.cache_groups import (
    RECURRENT,
    CacheSizes,
    allocate_caches,
    group_of,
    live_slots,
)
from updraft.attention.in_place import IN_PLACE_MAX_QUERY
from updraft.attention.metadata import NO_SPLIT, AttentionMetadata, ContextSplit, PrefillGather
from updraft.config import EngineConfig
from updraft.graph.sanitize import SanitizeReport, checked_replay, default_tolerance
from updraft.kernels.build import kernel_builds
from updraft.model_config import ModelConfig
from updraft.models.activations import int8_activations
from updraft.models.loader import load_model
from updraft.models.weight_memory import WeightMemory, settle_weights
from updraft.parallel.topology import GroupRank, ParallelSizes, RankPlace, rank_device
from updraft.runner.cache_sizes import (
    keeps_window_pool,
    positions_held,
    runner_cache_groups,
    runner_cache_sizes,
)
from updraft.runner.captured import Bucket, CapturedSteps
from updraft.runner.draft_loop import DraftLoop, DraftLoopInputs, greedy_drafts
from updraft.runner.logits_processors import adjust_logits
from updraft.runner.probe import Probe
from updraft.runner.rank_messages import HiddenRows, Send, loop_message, step_message
from updraft.runner.rejection_sampler import verify_step
from updraft.runner.sampler import TopLogprobs, prompt_logprobs, sample
from updraft.runner.token_mask import mask_logits, mask_wait, no_token_allowed, own_randomness_kept
from updraft.step.allowed_tokens import PendingMasks
from updraft.step.inputs import (
    GRAPH_INPUTS,
    ForwardInputs,
    GraphInput,
    RotarySwitch,
    SamplingInputs,
    StepInputs,
    graph_inputs,
    model_inputs,
)
from updraft.step.output import StepOutput
from updraft.step.plan import StateCopy
from updraft.step.prefill_split import PrefillSplit, split_step, splits


class Forward(NamedTuple):
    logits: torch.Tensor  # [len(inputs.sampling.logits_indices), vocab] float32
    hidden_states: torch.Tensor | None  # [num_tokens, hidden], when the step asks
    mode: str  # "graph" or "eager (why)"


class Tokens(NamedTuple):
    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: list[list[float]] | None
    top_logprobs: list[list[TopLogprobs]] | None = None


class Runner:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        config: EngineConfig,
        max_model_len: int,
        *,
        dtype: torch.dtype,
        name: str = "target",
        query_lens: tuple[int, ...] = (1,),
        num_blocks: int | None = None,
        num_state_slots: int | None = None,
        num_prefix_states: int | None = None,
        place: RankPlace | None = None,
        inputs: tuple[GraphInput, ...] = GRAPH_INPUTS,
        draft_loop_depth: int = 0,
        draft_loop: DraftLoop = greedy_drafts,
        splits_prefills: bool = True,
        send: Send | None = None,
        kv_caches: list[torch.Tensor] | None = None,
        window_pool: bool = False,
    ):
        """``model`` is what ``model_config`` describes, as this rank holds it (its
        cache follows the config's layers and this rank's KV heads), computing in
        ``dtype``; ``name`` says which model it is in step counts and probes. ``query_lens``:
        the uniform query lengths to capture (1 for decode steps, 1 + k for speculative
        verify steps). ``num_blocks``, ``num_state_slots``, ``num_prefix_states``: a
        proposer's runner takes the target's, since both page through the same block
        ids and state slots (a hybrid model's, ``attention/cache_groups.py``, and the
        prefix states after them, ``engine/prefix_states.py``). ``place``: this
        runner's rank of a model split over ranks, whose every other rank runs the same
        steps in its own process (engine/workers.py). ``inputs``: the declared graph
        inputs its forward reads (beyond ``GRAPH_INPUTS`` they reach the model as
        keyword arguments). A ``draft_loop_depth`` above 1 also captures ``draft_loop``
        of that many drafts (``draft_loop.py``). ``splits_prefills``:
        whether the prefill-context ranks split a long prefill (the target's), or each
        runs it whole (a replicated draft head's). ``send``: on rank 0 of a split
        model, how each forward is announced to the other ranks just before it runs
        (``rank_messages.py``). ``kv_caches``: another runner's, which a model that
        writes no KV reads (``model_config`` is that runner's): none are allocated.
        ``window_pool``: the windowed layers keep their KV in a pool of their own
        (``keeps_window_pool``), whose slots and block table ``inputs`` declare."""
        self.model = model
        self.model_config = model_config
        self.config = config
        self.max_model_len = max_model_len
        self.name = name
        self.device = torch.device(
            config.device if place is None else rank_device(config.device, place.rank)
        )
        self.dtype = dtype
        self.place = place
        self.inputs = inputs
        self.splits_prefills = splits_prefills
        self.send = send
        sizes = ParallelSizes() if place is None else place.sizes
        self.positions_per_block = config.positions_per_block
        self.context = (
            NO_SPLIT if sizes.decode_context == 1 else ContextSplit(decode=place.decode_context)
        )
        self.whole_query_len = max(query_lens)  # longer queries are split under PCP
        self.window_pool = window_pool
        self.cache_groups = runner_cache_groups(model_config, config, dtype, sizes, query_lens)
        cache_sizes = runner_cache_sizes(
            self.cache_groups, model_config, config, max_model_len, window_pool, max(query_lens)
        )
        self.num_blocks = cache_sizes.num_blocks if num_blocks is None else num_blocks
        self.num_state_slots = (
            cache_sizes.num_state_slots if num_state_slots is None else num_state_slots
        )
        self.num_prefix_states = (
            cache_sizes.num_prefix_states if num_prefix_states is None else num_prefix_states
        )
        self.num_window_blocks = cache_sizes.num_window_blocks  # 0: no pool of their own
        self.kv_caches = kv_caches or allocate_caches(
            self.cache_groups,
            model_config.num_layers,
            CacheSizes(
                self.num_blocks,
                self.num_state_slots,
                self.num_prefix_states,
                self.num_window_blocks,
            ),
            config.block_size,
            self.device,
            kv_sources=[model_config.kv_source(i) for i in range(model_config.num_layers)],
        )
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.greedy_loop = draft_loop
        self.captured = self._capture(query_lens, draft_loop_depth) if config.use_graphs else None
        # How each step ran: "graph" or "eager (<why>)", counted.
        self.step_modes: Counter[str] = Counter()
        self.sanitize_report = (
            SanitizeReport(default_tolerance(self.dtype)) if config.sanitize else None
        )
        rank = 0 if place is None else place.rank
        self.probe = None if config.probe is None else Probe(config.probe, name, rank)

    def _capture(self, query_lens: tuple[int, ...], draft_loop_depth: int) -> CapturedSteps:
        hidden = {"hidden": self.model_config.hidden_size}
        return CapturedSteps(
            self.model,
            self.kv_caches,
            self.positions_per_block,
            -(-self.max_model_len // self.positions_per_block),
            list(self.config.batch_capture_sizes),
            self.device,
            self.dtype,
            query_lens,
            inputs=self.inputs,
            compile_runs=self.config.compiles_graphs,
            full=self._full_graphs(query_lens),
            sizes_of_dims=hidden if len(self.inputs) > len(GRAPH_INPUTS) else None,
            context=self.context,
            owner=self.name,
            draft_loop_depth=draft_loop_depth,
            draft_loop=self.greedy_loop,
            mixed_tokens=self._mixed_tokens(),
            background=self.config.captures_in_background,  # one rank only
        )

    def _mixed_tokens(self) -> tuple[int, ...]:
        """The token counts of mixed steps to capture. None for a model with
        linear-attention layers: their chunked prefill is shaped by each request's query
        length, which a graph cannot take fresh (decode and verify buckets are uniform)."""
        if self.model_config.linear_layers:
            return ()
        limit = self.config.max_num_batched_tokens
        return tuple(n for n in self.config.mixed_capture_tokens if n <= limit)

    def _full_graphs(self, query_lens: tuple[int, ...]) -> frozenset[int]:
        """The query lengths whose graphs hold attention (FULL): all when asked, or with
        ``auto`` those where it costs nothing: attention that reads the cache in place
        (the CPU kernel in float32, for queries of up to IN_PLACE_MAX_QUERY tokens) takes
        a bucket's shapes for free, while gathering would attend over max_model_len,
        and DSA's indexer scores every position a request may have."""
        if self.config.graph_mode != "auto":
            return frozenset(query_lens) if self.config.graph_mode == "full" else frozenset()
        in_place = (
            self.device.type == "cpu"
            and self.dtype == torch.float32
            and kernel_builds("paged_attention")
            and self.model_config.indexer is None
        )
        return frozenset(q for q in query_lens if in_place and q <= IN_PLACE_MAX_QUERY)

    @cached_property
    def state_caches(self) -> list[torch.Tensor]:
        """Every linear-attention layer's state tensor (none for most models)."""
        recurrent = group_of(self.cache_groups, RECURRENT)
        return [] if recurrent is None else [self.kv_caches[i] for i in recurrent.layers]

    def copy_states(self, copies: tuple[StateCopy, ...]) -> None:
        """A step's state copies (prefix states saved and restored), in order, in every
        linear layer's state tensor: before its forward, which reads the restored rows."""
        for cache in self.state_caches:
            for src_slot, src_row, dst_slot, dst_row in copies:
                cache[dst_slot, dst_row].copy_(cache[src_slot, src_row])

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, allowed: PendingMasks | None = None) -> StepOutput:
        """The step's forward, then its tokens; ``allowed``: the tokens its constrained
        rows may take (being computed while the forward runs; the step waits for them
        only ``mask_wait``), applied before any filtering, sampling or verification.
        Logprobs stay those of the model's own logits."""
        start = time.perf_counter()
        forward = self.forward(inputs)
        if self.device.type == "cuda":  # sampling waits for the forward anyway
            torch.cuda.synchronize(self.device)
        forward_seconds = time.perf_counter() - start
        constraint = None if allowed is None else allowed.ready(*mask_wait(forward_seconds))
        sampling = inputs.sampling
        model_logits = forward.logits[: sampling.num_sampling_rows]
        scored = None
        if sampling.prompt_rows is not None:
            scored = prompt_logprobs(
                forward.logits[sampling.num_sampling_rows :], sampling.prompt_rows
            )
        logits = model_logits
        # The model's own logits are kept only where logprobs are read from them.
        keep = sampling.batch.want_logprobs
        if constraint is not None:
            logits = mask_logits(logits, constraint, in_place=not keep)
        if not sampling.adjustments.empty:
            logits = adjust_logits(
                logits, sampling.adjustments, in_place=logits is not model_logits or not keep
            )
        raw_logits = model_logits if keep and logits is not model_logits else None
        with own_randomness_kept(sampling.batch, constraint):
            tokens = self.sample(logits, sampling, raw_logits)
        request_ids = [inputs.request_ids[row] for row in inputs.sampling.rows]
        if self.probe is not None:
            rows = [1 + n for n in inputs.sampling.num_drafts]
            self.probe.sampled(request_ids, logits, rows, tokens.token_ids)
        return StepOutput(
            request_ids=request_ids,
            token_ids=tokens.token_ids,
            num_accepted=tokens.num_accepted,
            logprobs=tokens.logprobs,
            top_logprobs=tokens.top_logprobs,
            prompt_logprobs=scored,
            no_token_allowed=no_token_allowed(
                logits, sampling, tokens.num_accepted, request_ids, constraint is not None
            ),
            hidden_states=forward.hidden_states,
            forward_seconds=forward_seconds,
            mode=forward.mode,
        )

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, hidden_from: HiddenRows | None = None) -> Forward:
        """The logits at ``inputs.sampling.logits_indices`` (and hidden states when
        asked), by graph replay when the step fits a captured bucket, else eagerly;
        ``step_modes`` counts which. ``hidden_from``: where the other ranks find the
        step's hidden states (a draft head's; they hold them already)."""
        if self.send is not None:
            self.send(step_message(self.name, inputs, hidden_from))
        self.copy_states(inputs.state_copies)
        step = inputs.forward
        split = self._prefill_split(step)  # a split step runs eagerly, each rank its part
        bucket = (
            None if self.captured is None or split is not None else self.captured.bucket_for(step)
        )
        logits_indices = inputs.sampling.logits_indices.to(self.device)
        if bucket is not None:
            mode = "graph"
            # A decode or verify graph returns every row's logits; a mixed step's stops
            # at the hidden states (None), as an eager step does.
            hidden, logits = self._replay(step, bucket)
        else:
            why = (
                "graphs off"
                if self.captured is None
                else self.captured.why_not(step, inputs.sampling.num_drafts)
            )
            if split is not None:
                why += f", split over {split.size} ranks"
            mode = f"eager ({why})"
            hidden, logits = self._hidden_eager(step), None
        if logits is None:  # only the rows that sample
            logits = self.model.compute_logits(hidden.index_select(0, logits_indices))
        else:
            logits = logits.index_select(0, logits_indices)
        if bucket is not None and inputs.return_hidden_states:
            hidden = hidden.clone()  # a replay's rows are the graph's, until the next one
        self._count(mode, inputs.request_ids, step, bucket)
        return Forward(logits, hidden if inputs.return_hidden_states else None, mode)

    @property
    def rotary_switch(self) -> RotarySwitch | None:
        """How this model's steps pick rotary rows (LongRoPE), else None."""
        offset = getattr(getattr(self.model, "rotary", None), "long_offset", None)
        if offset is None:
            return None
        return RotarySwitch(self.model_config.rope.original_max_position_embeddings, offset)

    def fits_draft_loop(self, num_reqs: int) -> bool:
        return self.captured is not None and self.captured.loop_bucket_for(num_reqs) is not None

    @torch.inference_mode()
    def draft_loop(
        self,
        inputs: DraftLoopInputs,
        request_ids: list[str],
        hidden_from: HiddenRows | None = None,
    ) -> torch.Tensor:
        """Every request's greedy drafts [requests, depth] by one replay of the draft
        loop (``fits_draft_loop`` says whether one is captured for the batch); drafts
        past a request's limit are not drafts. Counted as the head steps whose drafts
        some request keeps. ``hidden_from``: as for ``forward``."""
        if self.send is not None:
            self.send(loop_message(self.name, inputs, request_ids, hidden_from))
        bucket = self.captured.loop_bucket_for(inputs.num_reqs)
        drafts = self.captured.run(inputs, bucket).clone()
        self._count("graph", request_ids, inputs, bucket, int(inputs.draft_limits.max()) - 1)
        return drafts

    def _count(
        self,
        mode: str,
        request_ids: list[str],
        step: ForwardInputs | DraftLoopInputs,
        bucket: Bucket | None = None,
        steps: int = 1,
    ) -> None:
        self.step_modes[mode] += steps
        if self.probe is not None:
            replayed = None if bucket is None else (bucket, self.captured.graphs[bucket])
            self.probe.step(mode, request_ids, step, replayed)

    def sample(
        self, logits: torch.Tensor, sampling: SamplingInputs, raw_logits: torch.Tensor | None = None
    ) -> Tokens:
        """Tokens of every request that samples: verified against its drafts when it
        carries any (a request without drafts in such a step is verified with none,
        which samples exactly as the plain sampler does). Logprobs are read from
        ``raw_logits`` (the model's, where ``logits`` were masked) when given."""
        if any(sampling.num_drafts):
            result = verify_step(logits, sampling, self.generator, raw_logits)
            return Tokens(
                result.token_ids, result.num_accepted, result.logprobs, result.top_logprobs
            )
        tokens, logprobs, top = sample(logits, sampling.batch, self.generator, raw_logits)
        return Tokens(
            [[token] for token in tokens.tolist()],
            [0] * len(sampling.batch),
            None if logprobs is None else [[lp] for lp in logprobs.tolist()],
            None if top is None else [[row] for row in top],
        )

    def close(self) -> None:
        """The end of this runner's engine: its probe, if any, records the KV caches."""
        if self.probe is not None:
            self.probe.closed(self.kv_caches)
            self.probe = None

    def _replay(self, step: ForwardInputs, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sanitize_report is None:
            return self.captured.run(step, bucket)
        hidden = []

        def replay() -> torch.Tensor:
            states, logits = self.captured.run(step, bucket)
            hidden.append(states)
            return self.model.compute_logits(states) if logits is None else logits.clone()

        groups = {layer: group for group in self.cache_groups for layer in group.layers}
        for layer in range(self.model_config.num_layers):  # a KV-shared layer: its source's
            groups.setdefault(layer, groups.get(self.model_config.kv_source(layer)))
        logits = checked_replay(
            replay,
            lambda kv_caches: self.model.compute_logits(self._hidden_eager(step, kv_caches)),
            self.kv_caches,
            self.sanitize_report,
            label=f"step {self.step_modes.total()} (bucket {tuple(bucket)}, {step.num_reqs} "
            "requests)",
            # the spare last slot takes padded writes
            live=lambda layer, cache: live_slots(cache, groups[layer]),
        )
        return hidden[0], logits

    def _prefill_split(self, step: ForwardInputs) -> GroupRank | None:
        """The prefill-context group that splits ``step``, if it is split."""
        group = None if self.place is None else self.place.prefill_context
        if group is None or group.size == 1 or not self.splits_prefills:
            return None
        if not splits(step, self.whole_query_len):
            return None
        return group

    def _hidden_eager(
        self, step: ForwardInputs, kv_caches: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        kv_caches = self.kv_caches if kv_caches is None else kv_caches
        group = self._prefill_split(step)
        if group is None:
            metadata = AttentionMetadata.from_step(
                step, self.positions_per_block, self.device, self.context
            )
            return self._model(step, kv_caches, metadata)
        split = split_step(step, group.rank, group.size, self.whole_query_len)
        gather = PrefillGather(group.group, group.size, split.kv_slot_mapping.to(self.device))
        context = ContextSplit(prefill=gather, decode=self.context.decode)
        local = split.local
        metadata = AttentionMetadata.from_step(
            local, self.positions_per_block, self.device, context
        )
        return in_step_order(self._model(local, kv_caches, metadata), group, split)

    def _model(
        self, step: ForwardInputs, kv_caches: list[torch.Tensor], metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The eager forward: the declared inputs beyond the standard ones reach the
        model as keyword arguments, as they do in a captured step."""
        extra = {
            spec.name: getattr(step, spec.name).to(self.device)
            for spec in model_inputs(self.inputs)
        }
        return self.model(
            step.input_ids.to(self.device),
            step.positions.to(self.device),
            kv_caches,
            metadata,
            **extra,
        )


def in_step_order(hidden: torch.Tensor, group: GroupRank, split: PrefillSplit) -> torch.Tensor:
    """Every rank's hidden states of a split step (``hidden``: this rank's, padded),
    gathered on every rank and put back in the step's order: what a head replicated
    across the group reads."""
    gathered = torch.ops.updraft.all_gather(hidden, group.group, group.size)
    return gathered.index_select(0, split.order.to(hidden.device))


def load_runner(
    model_config: ModelConfig,
    config: EngineConfig,
    max_model_len: int,
    *,
    name: str = "target",
    query_lens: tuple[int, ...] = (1,),
    num_blocks: int | None = None,
    num_state_slots: int | None = None,
    num_prefix_states: int | None = None,
    place: RankPlace | None = None,
    splits_prefills: bool = True,
    send: Send | None = None,
) -> Runner:
    """A runner over the checkpoint ``config.model`` (this rank's shard, with ``place``;
    ``send``: rank 0's announcer of its forwards to the other ranks)."""
    device = torch.device(rank_device(config.device, place.rank if place else None))
    dtype = config.compute_dtype(model_config)
    window_pool = keeps_window_pool(model_config, config, name, place)
    longrope = model_config.rope.kind == "longrope"
    if longrope and name != "target":
        raise ValueError(
            f"{config.model}: a {name} model with LongRoPE is not supported (its steps would "
            "need the target's rotary rows)"
        )
    # built for the positions its cache holds, not a config's max_position_embeddings
    sizes = ParallelSizes() if place is None else place.sizes
    groups = runner_cache_groups(model_config, config, dtype, sizes, query_lens)
    max_model_len = positions_held(config, model_config, groups, max_model_len, num_blocks)
    model = load_model(
        model_config,
        config.model,
        dtype,
        device,
        max_positions=max_model_len,
        weights=config.weight_format(model_config),
        place=place,
        int8_activations=int8_activations(config, model_config, draft=name != "target"),
    )
    settle_weights(model, WeightMemory(config.mmap, config.mlock))  # --no-mmap, --mlock
    return Runner(
        model,
        model_config,
        config,
        max_model_len,
        dtype=dtype,
        name=name,
        query_lens=query_lens,
        num_blocks=num_blocks,
        num_state_slots=num_state_slots,
        num_prefix_states=num_prefix_states,
        place=place,
        splits_prefills=splits_prefills,
        send=send,
        inputs=graph_inputs(
            rotary=longrope, state=bool(model_config.linear_layers), window=window_pool
        ),
        window_pool=window_pool,
    )
