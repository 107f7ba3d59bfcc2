"""/v1/chat/completions: the request and response bodies, tools included."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from updraft.sampling_params import MAX_TOP_LOGPROBS
from updraft.serve.errors import APIError
from updraft.serve.parsers.tools import required_spec
from updraft.serve.protocol import PromptLogprobs, SamplingRequest, Strict, Text, Usage
from updraft.serve.strict_schemas import strict_schema_error
from updraft.structured_outputs import StructuredOutputsParams

# Tools one request may offer: each becomes part of the prompt and of a grammar.
MAX_TOOLS = 128


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
    reasoning_content: Text | None = None  # an assistant's earlier reasoning

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
        if self.reasoning_content is not None:
            # Qwen3's templates read it by this name, gpt-oss's as "thinking".
            message["reasoning_content"] = message["thinking"] = self.reasoning_content
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


class ChatCompletionRequest(SamplingRequest):
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
    # OpenAI's; gpt-oss's template reads it (low, medium or high).
    reasoning_effort: Literal["low", "medium", "high"] | None = None

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
        for i, tool in enumerate(self.tools or []):
            function = tool.function
            problem = None
            if function.strict and function.parameters is not None:
                problem = strict_schema_error(function.parameters)
            if problem is not None:
                raise APIError(400, f"tools[{i}].function.parameters: {problem}", param="tools")
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

    def constraint_field(self) -> str | None:
        """The field a grammar on this request comes from, for a 400 to name: the tools
        when a call is required, else the structured-outputs field (if any)."""
        return "tools" if self.calls_required() else self.structured_outputs_field()

    def template_variables(self) -> dict[str, Any] | None:
        """chat_template_kwargs, with reasoning_effort where the request sets it."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def prompt_text_fields(self) -> list[tuple[str, str]]:
        """(field, its text as JSON) for every part of the request the chat template
        writes into the prompt."""
        fields = [
            (f"messages[{i}]", json.dumps(m.model_dump(), ensure_ascii=False))
            for i, m in enumerate(self.messages)
        ]
        fields += [
            (f"tools[{i}]", json.dumps(t.model_dump(), ensure_ascii=False))
            for i, t in enumerate(self.tools or [])
        ]
        if self.chat_template_kwargs:
            kwargs = json.dumps(self.chat_template_kwargs, ensure_ascii=False, default=str)
            fields.append(("chat_template_kwargs", kwargs))
        return fields

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
    reasoning_content: str | None = Field(default=None, exclude_if=lambda text: text is None)


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
    reasoning_content: str | None = None


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
