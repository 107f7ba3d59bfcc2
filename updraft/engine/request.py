"""A request's life inside the engine, and what the user gets back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from updraft.sampling import SamplingParams
from updraft.spec.metrics import SpecMetrics


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

    token_ids: list[int] = field(init=False)  # prompt then output, appended in place
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, in order
    num_registered_blocks: int = 0  # blocks offered to the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    logprobs: list[float] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    draft_token_ids: list[int] = field(default_factory=list)  # proposed, to verify next
    draft_probs: torch.Tensor | None = None  # [k, vocab] the drafts were drawn from
    spec: SpecMetrics = field(default_factory=SpecMetrics)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None
    logits: list[torch.Tensor] | None = None  # only with EngineConfig.keep_logits
    delta_text: str = ""  # what is new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int
    spec: SpecMetrics | None = None  # with speculative decoding

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
