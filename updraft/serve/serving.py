"""Completions and chat completions: from a validated request to a response or a stream.

Each request's first output is awaited before anything is sent, so a prompt the engine
refuses (empty, too long for the context) becomes a 400 even when streaming; after
that, a streaming request becomes server-sent events ending in ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from starlette.responses import StreamingResponse
from starlette.types import Send

from updraft.chat_template import ChatTemplate, ChatTemplateError
from updraft.engine.grammar_compiler import GrammarError
from updraft.engine.scheduler import STRUCTURED_ERROR
from updraft.outputs import RequestOutput
from updraft.sampling_params import SamplingParams
from updraft.serve.engine_loop import AsyncEngine, EngineDeadError, ShuttingDownError
from updraft.serve.errors import APIError, error_body
from updraft.serve.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprob,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    NamedToolChoice,
    Usage,
    new_id,
    now,
)
from updraft.serve.tool_parsers import ReplyStream, parse, reply_stream
from updraft.serve.tools import CallStream, default_parser
from updraft.tokenizer import Tokenizer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


@dataclass
class ServeSettings:
    """What the server enforces on top of the engine; see ``updraft serve --help``."""

    model_name: str
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_tokens_limit: int | None = None  # None: the engine's max_model_len
    max_waiting: int = 256
    drain_timeout: float = 60.0
    max_connections: int = 1024  # open at once; past it the idlest is closed
    request_timeout: float = 30.0  # seconds for a whole request to arrive
    tool_call_parser: str | None = None  # None: the one the chat template's syntax calls for

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty: it would let anyone in; use None for no key")


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body when the response ends however it ends, so a client gone
    mid-stream aborts its request at once instead of when the generator is collected."""

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


class OpenAIServing:
    def __init__(
        self, engine: AsyncEngine, settings: ServeSettings, chat_template: ChatTemplate
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.chat_template = chat_template
        self.tool_parser = settings.tool_call_parser or default_parser(chat_template.source)
        self.tokenizer: Tokenizer | None = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.max_tokens_limit = settings.max_tokens_limit or self.max_model_len
        # A longer text cannot fit in the context whatever it tokenizes to: refused
        # before any tokenizing.
        self.max_prompt_chars = (
            None if self.tokenizer is None else self.max_model_len * self.tokenizer.max_token_chars
        )

    # -- the two endpoints ---------------------------------------------------------------

    async def completion(self, body: CompletionRequest) -> JSONResponse | StreamingResponse:
        self._check_model(body.model)
        body.check_supported()
        params = body.sampling_params(
            COMPLETIONS_DEFAULT_MAX_TOKENS, self.max_tokens_limit, body.logprobs is not None
        )
        structured_field = body.structured_outputs_field()
        await self._compile(params, structured_field)
        prompt = await self._tokenized(body.single_prompt(), "prompt")
        request_id = new_id("cmpl")
        outputs, first = await self._start(request_id, prompt, params, "prompt", structured_field)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            events = self._completion_events(
                request_id, body.model, first, outputs, include_usage, body.return_token_ids
            )
            return ClosingStreamingResponse(_sse(events), media_type="text/event-stream")
        final = await _last(first, outputs)
        completion = final.outputs[0]
        response = CompletionResponse(
            id=request_id,
            created=now(),
            model=body.model,
            choices=[
                CompletionChoice(
                    text=completion.text,
                    logprobs=self._completion_logprobs(completion.token_ids, completion.logprobs),
                    finish_reason=completion.finish_reason,
                    token_ids=list(completion.token_ids) if body.return_token_ids else None,
                )
            ],
            usage=_usage(final),
        )
        return JSONResponse(response.model_dump())

    async def chat(self, body: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
        self._check_model(body.model)
        body.check_supported()
        params = body.sampling_params(self.max_tokens_limit, self.max_tokens_limit, body.logprobs)
        structured_field = "tools" if body.calls_required() else body.structured_outputs_field()
        await self._compile(params, structured_field)
        messages = [m.for_template() for m in body.messages]
        try:
            # Off the event loop: a template over a megabyte of messages takes a while.
            prompt = await asyncio.to_thread(
                self.chat_template.render,
                messages,
                True,
                body.chat_template_kwargs,
                body.template_tools(),
            )
        except ChatTemplateError as error:
            raise APIError(400, f"messages: {error}", param="messages") from error
        prompt = await self._tokenized(prompt, "messages")
        request_id = new_id("chatcmpl")
        outputs, first = await self._start(request_id, prompt, params, "messages", structured_field)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        replies = self._reply_stream(body)
        if body.stream:
            events = self._chat_events(
                request_id, body.model, first, outputs, include_usage, replies
            )
            return ClosingStreamingResponse(_sse(events), media_type="text/event-stream")
        final = await _last(first, outputs)
        completion = final.outputs[0]
        logprobs = None
        if body.logprobs:
            logprobs = self._chat_logprobs(completion.token_ids, completion.logprobs)
        content, calls = completion.text, []
        if replies is not None:
            content, calls = parse(replies, completion.text)
        response = ChatCompletionResponse(
            id=request_id,
            created=now(),
            model=body.model,
            choices=[
                ChatChoice(
                    message=ChatResponseMessage(
                        content=content if content.strip() or not calls else None,
                        tool_calls=[call.to_openai() for call in calls] or None,
                    ),
                    logprobs=logprobs,
                    finish_reason=_finish_reason(completion.finish_reason, bool(calls)),
                )
            ],
            usage=_usage(final),
        )
        return JSONResponse(response.model_dump())

    def _reply_stream(self, body: ChatCompletionRequest) -> ReplyStream | None:
        """What reads tool calls out of the reply: none without tools or with
        tool_choice none; the required or named function's JSON; else the model's own
        syntax through the server's parser."""
        choice = body.effective_tool_choice()
        if not body.tools or choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            return CallStream(named=choice.function.name)
        if choice == "required":
            return CallStream()
        return reply_stream(self.tool_parser)

    # -- shared steps --------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise APIError(
                404,
                f"model: {model!r} does not exist; this server serves {self.settings.model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def _compile(self, params: SamplingParams, field: str | None) -> None:
        """Compile the request's structured-output spec before the request is added, in
        the compiler's own threads (never on the event loop or the engine's thread), so
        that one that cannot compile is a 400 naming ``field``; the engine then finds it
        compiled."""
        spec = params.structured_outputs
        if spec is None:
            return
        compiler = self.engine.engine.grammar_compiler
        if compiler is None:
            raise APIError(
                400, f"{field}: structured outputs need the model's tokenizer", param=field
            )
        try:
            await asyncio.wrap_future(compiler.submit(spec))
        except GrammarError as error:
            raise APIError(400, f"{field}: {error.detail}", param=field) from error

    async def _tokenized(self, prompt: str | list[int], field: str) -> str | list[int]:
        """Token ids for a text prompt, tokenized in a worker thread: the engine thread,
        which steps every running request, never tokenizes (``tokenizers`` releases the
        GIL while it works). A text too long for any context is refused unread."""
        if isinstance(prompt, list) or self.tokenizer is None:
            return prompt
        if len(prompt) > self.max_prompt_chars:
            raise APIError(
                400,
                f"{field}: {len(prompt)} characters are more than {self.max_model_len} tokens, "
                "the context length, can hold",
                param=field,
            )
        return await asyncio.to_thread(self.tokenizer.encode, prompt)

    async def _start(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        field: str,
        structured_field: str | None = None,
    ) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
        """Admit the request and wait for its first output; a refused prompt is a 400
        naming ``field``, a grammar that failed as it ran one naming
        ``structured_field``."""
        if not self.engine.is_alive:
            raise APIError(503, "the engine has stopped; see the server log")
        if self.engine.num_waiting >= self.settings.max_waiting:
            raise APIError(
                503,
                f"the server is overloaded: {self.engine.num_waiting} requests are waiting; "
                "retry later",
                headers={"Retry-After": "1"},
            )
        outputs = self.engine.generate(request_id, prompt, params)
        try:
            first = await anext(outputs)
        except ShuttingDownError as error:
            raise APIError(503, str(error), headers={"Retry-After": "5"}) from error
        except EngineDeadError as error:
            raise APIError(503, str(error)) from error
        if first.error is not None:
            await outputs.aclose()
            error = first.error
            if structured_field is not None and error.startswith(STRUCTURED_ERROR):
                field, error = structured_field, error.removeprefix(STRUCTURED_ERROR)
            message = error if error.startswith(field) else f"{field}: {error}"
            raise APIError(400, message, param=field)
        return outputs, first

    async def _completion_events(
        self,
        request_id: str,
        model: str,
        first: RequestOutput,
        outputs: AsyncIterator[RequestOutput],
        include_usage: bool,
        return_token_ids: bool,
    ) -> AsyncIterator[str]:
        created = now()
        want_logprobs = first.outputs[0].logprobs is not None
        every_token = want_logprobs or return_token_ids
        offset = 0
        async with aclosing(_chain(first, outputs)) as stream:
            async for output in stream:
                completion = output.outputs[0]
                if not (completion.delta_text or completion.finish_reason or every_token):
                    continue  # text held back: a possible stop string or a partial character
                logprobs = None
                if want_logprobs and completion.delta_token_ids:
                    delta = completion.delta_token_ids
                    logprobs = self._completion_logprobs(delta, completion.delta_logprobs, offset)
                offset += len(completion.delta_text)
                choice = CompletionChoice(
                    text=completion.delta_text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    token_ids=list(completion.delta_token_ids) if return_token_ids else None,
                )
                chunk = CompletionResponse(
                    id=request_id, created=created, model=model, choices=[choice], usage=None
                )
                yield _event(chunk.model_dump())
                if output.finished and include_usage:
                    usage = CompletionResponse(
                        id=request_id,
                        created=created,
                        model=model,
                        choices=[],
                        usage=_usage(output),
                    )
                    yield _event(usage.model_dump())

    async def _chat_events(
        self,
        request_id: str,
        model: str,
        first: RequestOutput,
        outputs: AsyncIterator[RequestOutput],
        include_usage: bool,
        replies: ReplyStream | None = None,
    ) -> AsyncIterator[str]:
        created = now()
        want_logprobs = first.outputs[0].logprobs is not None
        called = False

        def chunk(delta: ChatDelta, finish_reason: str | None, logprobs=None, usage=None) -> str:
            choices = [] if usage else [ChatChunkChoice(delta=delta, finish_reason=finish_reason)]
            if logprobs is not None:
                choices[0].logprobs = logprobs
            body = ChatCompletionChunk(
                id=request_id, created=created, model=model, choices=choices, usage=usage
            ).model_dump()
            for choice in body["choices"]:  # a delta names only what it changes
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            return _event(body)

        yield chunk(ChatDelta(role="assistant", content=""), None)
        async with aclosing(_chain(first, outputs)) as stream:
            async for output in stream:
                completion = output.outputs[0]
                if not (completion.delta_text or completion.finish_reason or want_logprobs):
                    continue
                logprobs = None
                if want_logprobs and completion.delta_token_ids:
                    delta = completion.delta_token_ids
                    logprobs = self._chat_logprobs(delta, completion.delta_logprobs)
                text, tool_calls = completion.delta_text, None
                if replies is not None:  # calls taken out of the text
                    reply = replies.feed(text)
                    if completion.finish_reason is not None:
                        reply = reply + replies.finish()
                    text, tool_calls = reply.content, reply.tool_calls or None
                    called = called or bool(tool_calls)
                    finish = completion.finish_reason
                    if not (text or tool_calls or finish or want_logprobs):
                        continue
                delta = ChatDelta(content=text or None, tool_calls=tool_calls)
                finish_reason = _finish_reason(completion.finish_reason, called)
                yield chunk(delta, finish_reason, logprobs)
                if output.finished and include_usage:
                    yield chunk(ChatDelta(), None, usage=_usage(output))

    # -- logprobs ------------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer else str(token_id)

    def _completion_logprobs(
        self, token_ids: Sequence[int], logprobs: list[float] | None, offset: int = 0
    ) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        tokens = [self._token_text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return CompletionLogprobs(tokens=tokens, token_logprobs=list(logprobs), text_offset=offsets)

    def _chat_logprobs(
        self, token_ids: Sequence[int], logprobs: list[float] | None
    ) -> ChatChoiceLogprobs | None:
        if logprobs is None:
            return None
        content = []
        for token_id, logprob in zip(token_ids, logprobs, strict=True):
            text = self._token_text(token_id)
            content.append(
                ChatLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))
            )
        return ChatChoiceLogprobs(content=content)


async def _sse(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, then ``[DONE]``. The status line has gone out before the first
    event, so an engine failure mid-stream becomes an error event."""
    async with aclosing(events):
        try:
            async for event in events:
                yield event
        except EngineDeadError as error:
            yield _event(error_body(503, str(error)))
    yield "data: [DONE]\n\n"


async def _chain(
    first: RequestOutput, outputs: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    """The first output, then the rest; closing it aborts the request if unfinished."""
    yield first
    if first.finished:
        return
    try:
        async for output in outputs:
            yield output
    finally:
        await outputs.aclose()


async def _last(first: RequestOutput, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = first
    try:
        async with aclosing(_chain(first, outputs)) as stream:
            async for output in stream:
                final = output
    except EngineDeadError as error:
        raise APIError(503, str(error)) from error
    return final


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's tool_calls where a reply that made calls ended on its own."""
    return "tool_calls" if called and reason == "stop" else reason


def _usage(output: RequestOutput) -> Usage:
    prompt, completion = output.metrics.num_prompt_tokens, output.metrics.num_output_tokens
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
