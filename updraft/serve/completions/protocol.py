"""/v1/completions: the request and response bodies."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, Field

from updraft.sampling_params import MAX_TOP_LOGPROBS
from updraft.serve.errors import APIError
from updraft.serve.protocol import MAX_SEQUENCES, PromptLogprobs, SamplingRequest, Text, Usage


def _token_id_prompts(value: object) -> object:
    """A prompt of token ids whose first non-integer is named, with where it sits
    (pydantic's own message lists each of the four shapes a prompt may take)."""
    if not isinstance(value, list) or all(isinstance(item, str) for item in value):
        return value
    nested = any(isinstance(item, list) for item in value)
    for i, ids in enumerate(value if nested else [value]):
        if not isinstance(ids, list):
            raise ValueError(
                f"prompt[{i}] is {ids!r:.40}: a list of prompts holds only lists of token "
                "ids or only texts"
            )
        for j, token in enumerate(ids):
            if not isinstance(token, int) or isinstance(token, bool):
                where = f"prompt[{i}][{j}]" if nested else f"prompt[{j}]"
                raise ValueError(f"{token!r:.40} at {where} is not a token id (an integer)")
    return value


class CompletionRequest(SamplingRequest):
    # Text, token ids, or a list of either: one choice per prompt and per n, in order.
    prompt: Annotated[
        Text | list[int] | list[Text] | list[list[int]], BeforeValidator(_token_id_prompts)
    ]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    # vLLM's extension: each choice (each chunk, when streaming) carries its token ids,
    # so a client of a server without a tokenizer still sees every token arrive.
    return_token_ids: bool = False

    def prompt_logprobs_asked(self) -> int | None:
        """Echoed logprobs start with the prompt's (as vLLM: as many alternatives)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of: only 1 is supported", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix: not supported", param="suffix")
        sequences = len(self.prompts()) * self.n
        if sequences > MAX_SEQUENCES:
            raise APIError(
                400,
                f"prompt: {len(self.prompts())} prompts times n={self.n} are more than the "
                f"{MAX_SEQUENCES} sequences one request may start",
                param="prompt",
            )

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt: the list of prompts is empty", param="prompt")
        return list(prompt)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: the first echoed
    top_logprobs: list[dict[str, float] | None] | None = None  # with logprobs > 0
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda ids: ids is None)
    prompt_logprobs: PromptLogprobs | None = Field(
        default=None, exclude_if=lambda value: value is None
    )


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
