"""The request and response parts every endpoint shares, as pydantic models.

Requests are validated strictly (``"5"`` is not a number). Unknown fields are ignored,
as OpenAI-compatible servers do, so clients that send fields updraft has no use for
(``user``, ``metadata``) still work; each unknown name is logged once. Known fields
that updraft cannot honour (``best_of``, ``suffix``, the legacy ``functions``) are
refused with a 400 naming the field rather than silently ignored. Each endpoint's own
models are in its folder (serve/completions, serve/chat, serve/models); the dialects of
structured outputs are read in serve/structured_dialects.py.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from updraft.sampling_params import MAX_N, MAX_TOP_LOGPROBS, SamplingParams
from updraft.serve.errors import APIError, logger
from updraft.serve.structured_dialects import (
    DIALECT_FIELDS,
    structured_outputs_field,
    structured_outputs_params,
)
from updraft.structured_outputs import StructuredOutputsParams

# torch.Generator.manual_seed takes any 64-bit value, signed or unsigned.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# The sampler holds top_k in an int64 tensor; no vocabulary comes near this.
TOP_K_MAX = 2**31 - 1
# Sequences one request may start (prompts times n): each holds KV blocks of its own.
MAX_SEQUENCES = MAX_N
# Unknown field names are logged once each; past this many distinct names, no more.
MAX_LOGGED_UNKNOWN = 256
_logged_unknown: set[str] = set()


def _unicode(text: str) -> str:
    """JSON can carry a lone surrogate ("\\ud800"), which is not Unicode text: refuse it
    here, where the 400 names the field, instead of deep in the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"contains a lone surrogate at character {error.start}, which is not valid Unicode text"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class Strict(BaseModel):
    """A request part: values of the wrong type refused, unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk


def log_unknown_fields(names: list[str]) -> None:
    """Log each unknown request field once (as vLLM warns), bounded against clients
    that send a new name with every request."""
    for name in names:
        if name in _logged_unknown or len(_logged_unknown) >= MAX_LOGGED_UNKNOWN:
            continue
        _logged_unknown.add(name)
        logger.warning("ignoring unknown request field %r (logged once)", name[:80])


class SamplingRequest(BaseModel):
    """What completions and chat requests share: the model, sampling and structured outputs."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: Text
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=-1, le=TOP_K_MAX)
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    bad_words: list[Text] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    def check_supported(self) -> None:
        log_unknown_fields(list(self.model_extra or ()))
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "stream_options: only allowed when stream is true", param="stream_options"
            )

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_tokens"

    def prompt_logprobs_asked(self) -> int | None:
        return self.prompt_logprobs

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with its keys (token ids written as strings) as ints."""
        if self.logit_bias is None:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            bad = next(t for t in self.logit_bias if not t.strip().lstrip("-").isdigit())
            raise APIError(
                400, f"logit_bias: keys must be token ids, got {bad[:40]!r}", param="logit_bias"
            ) from None

    def structured_outputs_field(self) -> str | None:
        """The field that asks for structured outputs, if any; two are a 400."""
        return structured_outputs_field({name: getattr(self, name) for name in DIALECT_FIELDS})

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        return structured_outputs_params({name: getattr(self, name) for name in DIALECT_FIELDS})

    def sampling_params(
        self, default_max_tokens: int, max_tokens_limit: int, logprobs: bool | int
    ) -> SamplingParams:
        max_tokens = self.requested_max_tokens()
        max_tokens = default_max_tokens if max_tokens is None else max_tokens
        field = self.max_tokens_field()
        if max_tokens > max_tokens_limit:
            raise APIError(
                400,
                f"{field}: {max_tokens} is more than this server's limit of {max_tokens_limit}",
                param=field,
            )
        values = dict(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.token_bias(),
            min_tokens=self.min_tokens,
            bad_words=self.bad_words,
            allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            prompt_logprobs=self.prompt_logprobs_asked(),
        )
        structured_outputs = self.structured_outputs_params()
        try:
            return SamplingParams(
                **{name: value for name, value in values.items() if value is not None},
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                structured_outputs=structured_outputs,
                n=self.n,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
            )
        except ValueError as error:
            # SamplingParams names the field as "SamplingParams.<field> must be ...".
            message = str(error).removeprefix("SamplingParams.")
            param = message.split(" ", 1)[0]
            if param == "max_tokens":
                param, message = field, field + message.removeprefix("max_tokens")
            raise APIError(400, message, param=param) from error


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class PromptLogprob(BaseModel):
    logprob: float
    decoded_token: str


# vLLM's shape: per prompt position, {token id: its logprob}, null at the first.
PromptLogprobs = list[dict[str, PromptLogprob] | None]
