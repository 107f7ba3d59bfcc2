"""The engine: requests in, one scheduled forward per ``step()``, outputs out.

Single-threaded and synchronous; the offline ``LLM`` and the server drive it by calling
``step()`` in a loop. Bad requests finish with ``FinishReason.ERROR`` and a message;
they never stop other requests or leave blocks behind.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch

from updraft.config import EngineConfig, ModelConfig
from updraft.engine.kv_blocks import BlockPool, KVCacheManager
from updraft.engine.request import (
    CompletionOutput,
    FinishReason,
    Request,
    RequestMetrics,
    RequestOutput,
)
from updraft.engine.scheduler import Scheduler
from updraft.runner.runner import Runner
from updraft.runner.step import Step, decodes_first
from updraft.sampling import SamplingParams
from updraft.spec.speculator import Speculator, StepTokens
from updraft.tokenizer import Detokenizer, Tokenizer


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.context_len = config.max_model_len or self.model_config.max_position_embeddings
        k = config.num_speculative_tokens
        query_lens = (1, 1 + k) if config.speculative_method else (1,)
        self.runner = Runner(self.model_config, config, self.context_len, query_lens)
        self.block_pool = BlockPool(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        # A sequence never holds more tokens than the cache can, so one request alone
        # always fits and preemption always makes progress.
        self.max_model_len = min(self.context_len, self.runner.num_blocks * config.block_size)
        self.scheduler = Scheduler(
            KVCacheManager(self.block_pool), config.max_num_seqs, config.max_num_batched_tokens
        )
        self.speculator = None
        if config.speculative_method is not None:
            self.speculator = Speculator(config, self.runner, self.scheduler.kv, self.max_model_len)
        self.detokenizers: dict[str, Detokenizer] = {}
        self.pending_outputs: list[RequestOutput] = []
        self._ids = itertools.count()

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
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids, error = self._prompt_token_ids(prompt)
        request = Request(
            request_id, text, token_ids, params, self._eos_ids(params), time.perf_counter()
        )
        self.detokenizers[request_id] = Detokenizer(self.tokenizer, token_ids, params.stop)
        if error is None:
            error = self._check_length(len(token_ids))
        if error is not None:
            request.error = error
            self._finish(request, FinishReason.ERROR)
        else:
            self.scheduler.add(request)
        return request_id

    def _prompt_token_ids(self, prompt: str | Sequence[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return [], f"{self.config.model} has no tokenizer.json; pass token ids"
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

    def _eos_ids(self, params: SamplingParams) -> tuple[int, ...]:
        return () if params.ignore_eos else self.model_config.eos_token_ids

    def abort(self, request_id: str) -> bool:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, FinishReason.ABORT)
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self.pending_outputs)

    # -- stepping ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one forward; returns an output for every request that produced text or
        finished since the last call."""
        outputs, self.pending_outputs = self.pending_outputs, []
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:
            return outputs
        scheduler_output.scheduled = decodes_first(scheduler_output.scheduled)
        requests = [request for request, _ in scheduler_output.scheduled]
        step = Step.build(scheduler_output.scheduled, self.config.block_size)
        produced = self._run(step, requests)
        now = time.perf_counter()
        accepted = dict(zip(step.request_ids, produced.num_accepted, strict=True))
        sampled = {r.request_id for r in self.scheduler.update(scheduler_output, accepted)}
        for row, request in enumerate(requests):
            if request.request_id not in sampled:
                continue
            appended = []
            for i, token_id in enumerate(produced.token_ids[row]):
                logprob = None if produced.logprobs is None else produced.logprobs[row][i]
                logits = None if produced.logits is None else produced.logits[row][i]
                self._append_token(request, token_id, logprob, logits, now)
                appended.append(token_id)
                if request.finished:
                    break
            self.scheduler.release_unused_blocks(request)
            outputs.append(self._output(request, appended))
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        return outputs

    def _run(self, step: Step, requests: list[Request]) -> StepTokens:
        if self.speculator is not None:
            return self.speculator.run(step, requests)
        result = self.runner.execute(step)
        return StepTokens(
            token_ids=[[token] for token in result.token_ids],
            num_accepted=[0] * len(requests),
            logprobs=None if result.logprobs is None else [[lp] for lp in result.logprobs],
            logits=None if result.logits is None else [[row] for row in result.logits],
        )

    def _append_token(
        self,
        request: Request,
        token_id: int,
        logprob: float | None,
        logits: torch.Tensor | None,
        now: float,
    ) -> None:
        request.token_ids.append(token_id)
        if request.first_token_time is None:
            request.first_token_time = now
        if logprob is not None and request.sampling_params.logprobs:
            request.logprobs.append(logprob)
        if logits is not None:
            request.logits.append(logits)
        params = request.sampling_params
        stop_string = self.detokenizers[request.request_id].add(token_id)
        reason = FinishReason.STOP
        if token_id in request.eos_token_ids:
            request.stop_reason = None
        elif token_id in params.stop_token_ids:
            request.stop_reason = token_id
        elif stop_string is not None:
            request.stop_reason = stop_string
        elif (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        else:
            return
        self._finish(request, reason, emit=False)

    def _finish(self, request: Request, reason: FinishReason, emit: bool = True) -> None:
        self.scheduler.finish(request, reason)
        request.finish_time = time.perf_counter()
        if emit:
            self.pending_outputs.append(self._output(request, []))

    def _output(self, request: Request, delta_token_ids: list[int]) -> RequestOutput:
        detokenizer = self.detokenizers[request.request_id]
        delta_text = detokenizer.take(request.finished)
        if request.finished:
            del self.detokenizers[request.request_id]
        params = request.sampling_params
        completion = CompletionOutput(
            index=0,
            text=detokenizer.text[: detokenizer.emitted],
            token_ids=request.output_token_ids,
            finish_reason=None if request.finish_reason is None else str(request.finish_reason),
            stop_reason=request.stop_reason,
            logprobs=list(request.logprobs) if params.logprobs else None,
            logits=list(request.logits) if self.config.keep_logits else None,
            delta_text=delta_text,
            delta_token_ids=delta_token_ids,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.finished,
            metrics=RequestMetrics(
                arrival_time=request.arrival_time,
                first_token_time=request.first_token_time,
                finish_time=request.finish_time,
                num_prompt_tokens=request.num_prompt_tokens,
                num_output_tokens=request.num_output_tokens,
                num_preemptions=request.num_preemptions,
                spec=None if self.speculator is None else request.spec,
            ),
            error=request.error,
        )
