"""The model runner: owns the weights and the KV cache, runs one step at a time.

``execute(inputs)`` is the one way a step runs: the forward (a graph replay when the
step fits a captured bucket, else eager), then the tokens: requests that carry drafts
are verified by the rejection sampler, the others sampled, all in one ``StepOutput``.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import NamedTuple

import torch

from updraft.attention.cache_layout import (
    allocate_kv_cache,
    cache_layout,
    kv_cache_bytes_per_block,
)
from updraft.attention.in_place import IN_PLACE_MAX_QUERY
from updraft.attention.metadata import NO_SPLIT, AttentionMetadata, ContextSplit, PrefillGather
from updraft.config import EngineConfig, ModelConfig
from updraft.graph.sanitize import SanitizeReport, checked_replay, default_tolerance
from updraft.kernels.ops import kernel_builds
from updraft.models.loader import load_model
from updraft.models.tensor_parallel import local_config
from updraft.parallel.topology import GroupRank, ParallelSizes, RankPlace, rank_device
from updraft.runner.captured import Bucket, CapturedSteps
from updraft.runner.rejection_sampler import verify_step
from updraft.runner.sampler import sample
from updraft.step.inputs import StepInputs
from updraft.step.output import StepOutput
from updraft.step.prefill_split import split_step, splits


class Forward(NamedTuple):
    logits: torch.Tensor  # [len(inputs.logits_indices), vocab] float32
    hidden_states: torch.Tensor | None  # [num_tokens, hidden], when the step asks
    mode: str  # "graph" or "eager (why)"


class Tokens(NamedTuple):
    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: list[list[float]] | None


class Runner:
    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        max_model_len: int,
        query_lens: tuple[int, ...] = (1,),
        num_blocks: int | None = None,
        place: RankPlace | None = None,
    ):
        """``query_lens``: the uniform query lengths to capture (1 for decode steps,
        1 + k for speculative verify steps). ``num_blocks``: a draft model's runner
        takes the target's, since both page through the same block ids.
        ``place``: this runner's rank of a model split over ranks, whose every other
        rank runs the same steps in its own process (engine/workers.py)."""
        self.model_config = model_config
        self.config = config
        self.device = torch.device(
            config.device if place is None else rank_device(config.device, place.rank)
        )
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"device {config.device!r} was asked for, but this PyTorch ({torch.__version__}) "
                "sees no CUDA device; use --device cpu, or install a CUDA build (README)"
            )
        self.dtype = config.compute_dtype(model_config)
        self.place = place
        sizes = ParallelSizes() if place is None else place.sizes
        # Positions per KV block as steps address them: a decode-context rank keeps
        # block_size of each block's C * block_size positions.
        self.positions_per_block = config.positions_per_block
        self.context = (
            NO_SPLIT if sizes.decode_context == 1 else ContextSplit(decode=place.decode_context)
        )
        self.whole_query_len = max(query_lens)  # longer queries are split under PCP
        self.model = load_model(
            model_config,
            config.model,
            self.dtype,
            self.device,
            max_positions=max_model_len,
            quantization=config.quantization,
            place=place,
        )
        self.cache_layout = cache_layout(local_config(model_config, sizes))
        self.num_blocks = self._num_blocks() if num_blocks is None else num_blocks
        self.kv_caches = allocate_kv_cache(
            model_config.num_layers,
            self.num_blocks,
            config.block_size,
            self.cache_layout,
            self.dtype,
            self.device,
        )
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.captured = None
        if config.use_graphs:
            self.captured = CapturedSteps(
                self.model,
                self.kv_caches,
                self.positions_per_block,
                -(-max_model_len // self.positions_per_block),
                list(config.capture_sizes),
                self.device,
                query_lens,
                compile_runs=config.compiles_graphs,
                full=self._full_graphs(query_lens),
                context=self.context,
            )
        # How each step ran: "graph" or "eager (<why>)", counted.
        self.step_modes: Counter[str] = Counter()
        self.sanitize_report = (
            SanitizeReport(default_tolerance(self.dtype)) if config.sanitize else None
        )

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

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = kv_cache_bytes_per_block(
            self.model_config.num_layers,
            self.config.block_size,
            self.cache_layout,
            self.dtype,
        )
        num_blocks = int(self.config.kv_cache_memory_gib * 2**30) // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_gib={self.config.kv_cache_memory_gib} holds no KV block "
                f"({per_block} bytes each)"
            )
        return num_blocks

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> StepOutput:
        start = time.perf_counter()
        forward = self.forward(inputs)
        if self.device.type == "cuda":  # sampling waits for the forward anyway
            torch.cuda.synchronize(self.device)
        forward_seconds = time.perf_counter() - start
        tokens = self.sample(forward.logits, inputs)
        return StepOutput(
            request_ids=[inputs.request_ids[row] for row in inputs.sampling_rows],
            token_ids=tokens.token_ids,
            num_accepted=tokens.num_accepted,
            logprobs=tokens.logprobs,
            hidden_states=forward.hidden_states,
            forward_seconds=forward_seconds,
            mode=forward.mode,
        )

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> Forward:
        """The logits at ``inputs.logits_indices`` (and hidden states when asked), by
        graph replay when the step fits a captured bucket, else eagerly;
        ``step_modes`` counts which."""
        bucket = None if self.captured is None else self.captured.bucket_for(inputs)
        if bucket is not None:
            mode = "graph"
            hidden, logits = self._replay(inputs, bucket)
            logits = logits.index_select(0, inputs.logits_indices.to(self.device))
            if inputs.return_hidden_states:
                hidden = hidden.clone()
        else:
            why = "graphs off" if self.captured is None else self.captured.why_not(inputs)
            split = self._prefill_split(inputs)
            if split is not None:
                why += f", split over {split.size} ranks"
            mode = f"eager ({why})"
            hidden = self._hidden_eager(inputs)
            logits = self.model.compute_logits(
                hidden.index_select(0, inputs.logits_indices.to(self.device))
            )
        self.step_modes[mode] += 1
        return Forward(logits, hidden if inputs.return_hidden_states else None, mode)

    def sample(self, logits: torch.Tensor, inputs: StepInputs) -> Tokens:
        """Tokens of every request that samples: verified against its drafts when it
        carries any (a request without drafts in such a step is verified with none,
        which samples exactly as the plain sampler does)."""
        if any(inputs.num_drafts):
            result = verify_step(logits, inputs, self.generator)
            return Tokens(result.token_ids, result.num_accepted, result.logprobs)
        tokens, logprobs = sample(logits, inputs.sampling, self.generator)
        return Tokens(
            [[token] for token in tokens.tolist()],
            [0] * len(inputs.sampling),
            None if logprobs is None else [[lp] for lp in logprobs.tolist()],
        )

    def _replay(self, inputs: StepInputs, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sanitize_report is None:
            return self.captured.run(inputs, bucket)
        hidden = []

        def replay() -> torch.Tensor:
            states, logits = self.captured.run(inputs, bucket)
            hidden.append(states)
            return logits.clone()

        slot_dim = self.cache_layout.slot_dim
        logits = checked_replay(
            replay,
            lambda kv_caches: self.model.compute_logits(self._hidden_eager(inputs, kv_caches)),
            self.kv_caches,
            self.sanitize_report,
            label=f"step {self.step_modes.total()} (bucket {bucket}, {inputs.num_reqs} requests)",
            # the spare last slot takes padded writes
            live=lambda kv_cache: kv_cache.narrow(slot_dim, 0, kv_cache.shape[slot_dim] - 1),
        )
        return hidden[0], logits

    def _prefill_split(self, inputs: StepInputs) -> GroupRank | None:
        """The prefill-context group that splits ``inputs``, if it is split."""
        group = None if self.place is None else self.place.prefill_context
        if group is None or group.size == 1 or not splits(inputs, self.whole_query_len):
            return None
        return group

    def _hidden_eager(
        self, inputs: StepInputs, kv_caches: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        kv_caches = self.kv_caches if kv_caches is None else kv_caches
        group = self._prefill_split(inputs)
        if group is None:
            metadata = AttentionMetadata.from_step(
                inputs, self.positions_per_block, self.device, self.context
            )
            return self.model(
                inputs.input_ids.to(self.device),
                inputs.positions.to(self.device),
                kv_caches,
                metadata,
            )
        split = split_step(inputs, group.rank, group.size, self.whole_query_len)
        local = split.local
        gather = PrefillGather(group.group, group.size, split.kv_slot_mapping.to(self.device))
        context = ContextSplit(prefill=gather, decode=self.context.decode)
        metadata = AttentionMetadata.from_step(
            local, self.positions_per_block, self.device, context
        )
        hidden = self.model(
            local.input_ids.to(self.device), local.positions.to(self.device), kv_caches, metadata
        )
        gathered = torch.ops.updraft.all_gather(hidden, group.group, group.size)
        return gathered.index_select(0, split.order.to(self.device))


def describe_steps(step_modes: dict[str, int]) -> str:
    """How steps ran, from a runner's ``step_modes``: e.g. "1 eager (prefill), 63 graph"."""
    return ", ".join(f"{n} {mode}" for mode, n in sorted(step_modes.items()))
