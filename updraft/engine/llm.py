"""The offline API: ``LLM(model_dir).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from updraft.config import EngineConfig
from updraft.demo import DEMO_MODEL_DIR
from updraft.engine.engine import Engine
from updraft.engine.workers import WorkerPool
from updraft.outputs import RequestOutput, merge_outputs
from updraft.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Generate from a local Hugging Face checkpoint directory.

    Keyword arguments are ``EngineConfig`` fields, e.g. ``dtype="float32"``,
    ``max_num_seqs=32``, ``kv_cache_memory_gib=2``. Without a model, the shipped demo
    model is used. ``worker_pool``: a ``WorkerPool`` whose processes run the other ranks
    of a split model, reused by engine after engine.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        worker_pool: WorkerPool | None = None,
        **engine_args: Any,
    ) -> None:
        known = {f.name for f in fields(EngineConfig)} - {"model"}
        unknown = set(engine_args) - known
        if unknown:
            raise TypeError(f"unknown engine arguments {sorted(unknown)}; known: {sorted(known)}")
        config = EngineConfig(model=str(model or DEMO_MODEL_DIR), **engine_args)
        self.engine = Engine(config, worker_pool)
        # Intake (engine/input_processor.py): the same as the server's API processes run.
        self.input_processor = self.engine.input_processor

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_special_tokens: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order, each with
        its ``n`` completions in index order. A text prompt gets the tokenizer's BOS
        unless ``add_special_tokens`` is False."""
        latest: dict[str, dict[int, RequestOutput]] = {}
        request_ids = self._add(prompts, sampling_params, add_special_tokens)
        for output in self._run(request_ids):
            latest.setdefault(output.request_id, {})[output.outputs[0].index] = output
        return [merge_outputs(list(latest[request_id].values())) for request_id in request_ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of ``{"role", "content"}`` messages) or to
        several; each is rendered with the checkpoint's chat template, or updraft's
        simple one when it has none, exactly as ``updraft serve`` renders it. With
        ``continue_final_message`` (and ``add_generation_prompt`` False) the reply goes
        on with the last message instead of starting a new one."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.input_processor.render_chat(
                list(c), add_generation_prompt, continue_final_message=continue_final_message
            )
            for c in conversations
        ]
        special = self.input_processor.chat_adds_special_tokens
        return self.generate(prompts, sampling_params, add_special_tokens=special)

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield an output each time a request gets new tokens or finishes; its
        ``outputs[0].delta_text`` and ``delta_token_ids`` are what is new. ``abort`` may
        be called between yields."""
        yield from self._run(self._add(prompts, sampling_params))

    def abort(self, request_id: str) -> bool:
        """Stop a request; returns False when it is unknown or already finished."""
        return self.engine.abort(request_id)

    def _add(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        add_special_tokens: bool = True,
    ) -> list[str]:
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling params for {len(prompts)} prompts"
            )
        # Check everything before queueing anything, so a bad list adds no request.
        for params in sampling_params:
            if not isinstance(params, SamplingParams):
                raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
        return [
            self.engine.add(self.input_processor.process(prompt, params, add_special_tokens))
            for prompt, params in zip(prompts, sampling_params, strict=True)
        ]

    def _run(self, request_ids: list[str]) -> Iterator[RequestOutput]:
        pending = set(request_ids)
        try:
            while pending and self.engine.has_unfinished:
                for output in self.engine.step():
                    if output.request_id in pending:
                        if output.finished:
                            pending.discard(output.request_id)
                        yield output
        finally:
            # A stream closed early (or an error) must not leave its requests running.
            for request_id in pending:
                self.engine.abort(request_id)
