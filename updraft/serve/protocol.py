"""The OpenAI request and response bodies, as pydantic models.

Requests are validated strictly (``"5"`` is not a number). Unknown fields are ignored,
as OpenAI-compatible servers do, so clients that send fields updraft has no use for
(``user``, ``metadata``) still work; each unknown name is logged once. Known fields
that updraft cannot honour (``best_of``, ``suffix``, the legacy ``functions``) are
refused with a 400 naming the field rather than silently ignored.

Structured outputs come in three shapes, all on both routes: OpenAI's
``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs``
object, and vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` fields. A request names at most one of them.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from updraft.sampling_params import MAX_N, MAX_TOP_LOGPROBS, SamplingParams
from updraft.serve.errors import APIError, logger
from updraft.serve.tools import required_spec
from updraft.structured_outputs import StructuredOutputsParams

# Tools one request may offer: each becomes part of the prompt and of a grammar.
MAX_TOOLS = 128
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


class _Request(BaseModel):
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
        given = [name for name in GUIDED_FIELDS if getattr(self, name) is not None]
        if self.structured_outputs is not None:
            given.append("structured_outputs")
        if self.response_format is not None and self.response_format.get("type") != "text":
            given.append("response_format")
        if len(given) > 1:
            raise APIError(
                400,
                f"{given[1]}: only one way of asking for structured outputs per request, "
                f"got {', '.join(given)}",
                param=given[1],
            )
        return given[0] if given else None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        field = self.structured_outputs_field()
        if field is None:
            if self.response_format is not None:
                _response_format(self.response_format)  # a text one, checked all the same
            return None
        if field == "response_format":
            values = _response_format(self.response_format)
        elif field == "structured_outputs":
            values = _structured_outputs(self.structured_outputs)
        else:
            values = {GUIDED_FIELDS[field]: getattr(self, field)}
        try:
            return StructuredOutputsParams(**values)
        except ValueError as error:
            message = str(error).removeprefix("structured_outputs")
            raise APIError(400, f"{field}{message}", param=field) from error

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


class CompletionRequest(_Request):
    # Text, token ids, or a list of either: one choice per prompt and per n, in order.
    prompt: Text | list[int] | list[Text] | list[list[int]]
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


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class FunctionCall(Strict):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class MessageToolCall(Strict):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # what a tool message answers

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: content a string, a call's arguments
        a dict (as transformers hands them), a tool result's call id kept."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise APIError(
            400,
            f"messages: a tool call's arguments must be a JSON object, got {text[:60]!r}",
            param="messages",
        )
    return value


# A function name as OpenAI allows it.
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDefinition(Strict):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: Text


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None  # OpenAI's legacy form of tools: refused by name
    function_call: Any = None
    # More variables for the chat template, such as Qwen3's enable_thinking.
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(
                400,
                "continue_final_message: cannot be true with add_generation_prompt (set it "
                "to false to continue the final message)",
                param="continue_final_message",
            )
        for legacy in ("functions", "function_call"):
            if getattr(self, legacy) is not None:
                raise APIError(
                    400, f"{legacy}: the legacy functions API is not supported; use tools",
                    param=legacy,
                )  # fmt: skip
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise APIError(400, "tool_choice: needs tools to choose from", param="tool_choice")
        if isinstance(choice, NamedToolChoice):
            names = [tool.function.name for tool in self.tools]
            if choice.function.name not in names:
                raise APIError(
                    400,
                    f"tool_choice: no tool is named {choice.function.name!r} (tools: "
                    f"{', '.join(names)})",
                    param="tool_choice",
                )
        if self.calls_required() and self.structured_outputs_field() is not None:
            raise APIError(
                400,
                f"tool_choice: a required tool call and {self.structured_outputs_field()} "
                "both constrain the reply; send one",
                param="tool_choice",
            )

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """none, auto, required or a named function (OpenAI's defaults: auto with tools,
        none without)."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    def calls_required(self) -> bool:
        choice = self.effective_tool_choice()
        return choice == "required" or isinstance(choice, NamedToolChoice)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (none when tool_choice is none)."""
        if not self.tools or self.effective_tool_choice() == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        if not self.calls_required():
            return super().structured_outputs_params()
        choice = self.effective_tool_choice()
        named = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools]
        try:
            return required_spec(tools, named, self.parallel_tool_calls)
        except ValueError as error:
            raise APIError(400, f"tools: {error}", param="tools") from error

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def logprobs_asked(self) -> bool | int:
        """SamplingParams.logprobs: False, or the alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else False


# vLLM's older fields, and the StructuredOutputsParams field each one is.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# vLLM's structured_outputs keys that choose among its backends: nothing to choose here.
IGNORED_STRUCTURED_KEYS = {"disable_fallback"}


def _response_format(value: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's response_format as StructuredOutputsParams fields."""
    kind = value.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(
                400,
                "response_format.json_schema.schema: a JSON schema object is required",
                param="response_format",
            )
        return {"json": schema}
    raise APIError(
        400,
        f"response_format.type: must be text, json_object or json_schema, got {kind!r}",
        param="response_format",
    )


def _structured_outputs(value: dict[str, Any]) -> dict[str, Any]:
    """vLLM's structured_outputs object as StructuredOutputsParams fields."""
    known = {"json", "json_object", "regex", "choice", "grammar"}
    unknown = sorted(set(value) - known - IGNORED_STRUCTURED_KEYS)
    if unknown:
        raise APIError(
            400,
            f"structured_outputs.{unknown[0]}: not supported (supported: "
            f"{', '.join(sorted(known))})",
            param="structured_outputs",
        )
    return {k: v for k, v in value.items() if k in known and v not in (None, False)}


# -- responses ---------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: the first echoed
    top_logprobs: list[dict[str, float] | None] | None = None  # with logprobs > 0
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    decoded_token: str


# vLLM's shape: per prompt position, {token id: its logprob}, null at the first.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprob]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = Field(
        default=None, exclude_if=lambda calls: calls is None
    )


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(
        default=None, exclude_if=lambda value: value is None
    )


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = Field(
        default=None, exclude_if=lambda value: value is None
    )


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "updraft"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
