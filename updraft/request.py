"""A request's life inside the engine: its tokens, its KV blocks, where it stands.

The scheduler is the only writer of a running request. A request holds no draft
tokens: drafts travel in the step plan, from the proposer to the verify step.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from updraft.outputs import (
    CompletionOutput,
    OutputSoFar,
    RequestMetrics,
    RequestOutput,
    SpeculativeMetrics,
)
from updraft.sampling_params import SamplingParams
from updraft.tokenizer import Detokenizer

if TYPE_CHECKING:
    import torch


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string; ``stop_reason`` says which
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"
    ERROR = "error"  # the request could not be served; ``error`` says why


@dataclass(eq=False)  # identity: the scheduler finds requests in its queues by object
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.perf_counter)
    detokenizer: Detokenizer = field(default_factory=lambda: Detokenizer(None, [], []))
    # bad_words as token sequences: the last token is banned where the rest ends the output.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    token_ids: list[int] = field(init=False)  # prompt then output, appended in place
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # keys of full blocks, in order
    num_registered_blocks: int = 0  # blocks offered to the prefix cache
    # Leading blocks given back because no sliding window reaches them any more; their
    # ids stay in block_ids (the block table keeps its positions) but are never read.
    num_released_blocks: int = 0
    # A model whose windowed layers have a pool of their own: the request's blocks there,
    # one per entry of block_ids (the same positions), and how many leading ones are not
    # held (given back, or never taken on a prefix hit: no window reaches them).
    window_block_ids: list[int] = field(default_factory=list)
    num_window_released: int = 0
    # A hybrid model's recurrent-state slot (conv window and linear-attention state of
    # every linear layer), held from admission to finish or preemption; -1: none.
    state_slot: int = -1
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # when k were asked
    # Position i: {prompt token i: its logprob, then the likeliest}; None at position 0.
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=lambda: [None])
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    speculative: SpeculativeMetrics = field(default_factory=SpeculativeMetrics)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.sampling_params.seed is not None:
            # Only a seeded request needs torch here: an API process's records carry no
            # seed (serve/served_request.py), and that process never loads torch.
            import torch

            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def take_output(
        self,
        delta_token_ids: list[int],
        delta_logprobs: list[float] | None,
        speculative: bool = False,
    ) -> RequestOutput:
        """The output for what is new since the last one: it takes the text decoded
        since then. Whole-sequence fields are read lazily from the append-only lists."""
        delta_text = self.detokenizer.take(self.finished)
        wants_logprobs = self.sampling_params.returns_logprobs
        wants_top = wants_logprobs and self.sampling_params.num_top_logprobs > 0
        completion = CompletionOutput(
            delta_text=delta_text,
            delta_token_ids=delta_token_ids,
            delta_logprobs=delta_logprobs if wants_logprobs else None,
            delta_top_logprobs=(
                self.top_logprobs[len(self.top_logprobs) - len(delta_token_ids) :]
                if wants_top
                else None
            ),
            finish_reason=None if self.finish_reason is None else str(self.finish_reason),
            stop_reason=self.stop_reason,
            so_far=OutputSoFar(
                self.token_ids,
                self.num_prompt_tokens,
                self.num_tokens,
                self.detokenizer.pieces,
                len(self.detokenizer.pieces),
                self.logprobs if wants_logprobs else None,
                len(self.logprobs),
                self.top_logprobs if wants_top else None,
            ),
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=(
                None if self.sampling_params.prompt_logprobs is None else self.prompt_logprobs
            ),
            outputs=[completion],
            finished=self.finished,
            metrics=RequestMetrics(
                arrival_time=self.arrival_time,
                first_token_time=self.first_token_time,
                finish_time=self.finish_time,
                num_prompt_tokens=self.num_prompt_tokens,
                num_output_tokens=self.num_output_tokens,
                num_preemptions=self.num_preemptions,
                speculative=self.speculative if speculative else None,
            ),
            error=self.error,
        )
