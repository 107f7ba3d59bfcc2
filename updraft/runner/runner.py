"""The model runner: owns the weights and the KV cache, runs one Step at a time."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from updraft.attention.metadata import AttentionMetadata
from updraft.attention.paged import allocate_kv_cache, kv_cache_bytes_per_block
from updraft.config import EngineConfig, ModelConfig
from updraft.graph.sanitize import SanitizeReport, checked_replay, default_tolerance
from updraft.models.loader import load_model
from updraft.runner.captured import Bucket, CapturedSteps
from updraft.runner.sampler import sample
from updraft.runner.step import Step


@dataclass
class RunnerOutput:
    token_ids: list[int]  # one per request in the step, in step order
    logprobs: list[float] | None
    logits: torch.Tensor | None  # [num_reqs, vocab] float32, with keep_logits


class Runner:
    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        max_model_len: int,
        query_lens: tuple[int, ...] = (1,),
        num_blocks: int | None = None,
    ):
        """``query_lens``: the uniform query lengths to capture (1 for decode steps,
        1 + k for speculative verify steps). ``num_blocks``: a draft model's runner
        takes the target's, since both page through the same block ids."""
        self.model_config = model_config
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.compute_dtype(model_config)
        self.block_size = config.block_size
        self.model = load_model(
            model_config, config.model, self.dtype, self.device, max_positions=max_model_len
        )
        self.num_blocks = self._num_blocks() if num_blocks is None else num_blocks
        self.kv_caches = allocate_kv_cache(
            model_config.num_layers,
            self.num_blocks,
            self.block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            self.dtype,
            self.device,
        )
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.captured = None
        if config.use_graphs:
            self.captured = CapturedSteps(
                self.model,
                self.kv_caches,
                self.block_size,
                -(-max_model_len // self.block_size),
                list(config.capture_sizes),
                self.device,
                query_lens,
            )
        # How each step ran: "graph" or "eager (<why>)", counted.
        self.step_modes: Counter[str] = Counter()
        self.sanitize_report = (
            SanitizeReport(default_tolerance(self.dtype)) if config.sanitize else None
        )

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = kv_cache_bytes_per_block(
            self.model_config.num_layers,
            self.block_size,
            self.model_config.num_kv_heads,
            self.model_config.head_dim,
            self.dtype,
        )
        num_blocks = int(self.config.kv_cache_memory_gib * 2**30) // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_gib={self.config.kv_cache_memory_gib} holds no KV block "
                f"({per_block} bytes each)"
            )
        return num_blocks

    def describe_steps(self) -> str:
        """How the steps so far ran, e.g. "1 eager (prefill), 63 graph"."""
        return ", ".join(f"{n} {mode}" for mode, n in sorted(self.step_modes.items()))

    @torch.inference_mode()
    def forward(self, step: Step) -> torch.Tensor:
        """Logits [len(step.logits_indices), vocab] of one step, by graph replay when
        the step fits a captured bucket, else eagerly; ``step_modes`` counts which."""
        bucket = None if self.captured is None else self.captured.bucket_for(step)
        if bucket is not None:
            self.step_modes["graph"] += 1
            logits = self._replay(step, bucket)
            return logits.index_select(0, step.logits_indices.to(self.device))
        why = "graphs off" if self.captured is None else self.captured.why_not(step)
        self.step_modes[f"eager ({why})"] += 1
        return self._forward_eager(step)

    @torch.inference_mode()
    def execute(self, step: Step) -> RunnerOutput:
        logits = self.forward(step)
        tokens, logprobs = sample(logits, step.sampling, self.generator)
        return RunnerOutput(
            token_ids=tokens.tolist(),
            logprobs=None if logprobs is None else logprobs.tolist(),
            logits=logits.cpu() if self.config.keep_logits else None,
        )

    def _replay(self, step: Step, bucket: Bucket) -> torch.Tensor:
        if self.sanitize_report is None:
            return self.captured.run(step, bucket)
        return checked_replay(
            lambda: self.captured.run(step, bucket),
            lambda kv_caches: self._forward_eager(step, kv_caches, all_tokens=True),
            self.kv_caches,
            self.sanitize_report,
            label=f"step {self.step_modes.total()} (bucket {bucket}, {step.num_reqs} requests)",
            live=lambda kv_cache: kv_cache[:, :-1],  # the spare slot takes padded writes
        )

    def _forward_eager(
        self, step: Step, kv_caches: list[torch.Tensor] | None = None, all_tokens: bool = False
    ) -> torch.Tensor:
        metadata = AttentionMetadata.from_step(step, self.block_size, self.device)
        hidden = self.model(
            step.input_ids.to(self.device),
            step.positions.to(self.device),
            self.kv_caches if kv_caches is None else kv_caches,
            metadata,
        )
        if not all_tokens:
            hidden = hidden.index_select(0, step.logits_indices.to(self.device))
        return self.model.compute_logits(hidden)
