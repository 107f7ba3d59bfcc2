"""Completions and chat completions: from a validated request to a response or a stream.

Each request's first output is awaited before anything is sent, so a prompt the engine
refuses (empty, too long for the context) becomes a 400 even when streaming; after
that, a streaming request becomes server-sent events ending in ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TypeVar

from fastapi.responses import JSONResponse
from starlette.responses import StreamingResponse
from starlette.types import Send

from updraft.chat_template import ChatTemplate, ChatTemplateError
from updraft.engine.grammar_compiler import GrammarCompiler, GrammarError
from updraft.engine.input_processor import EngineRequest, InputProcessor
from updraft.engine.scheduler import STRUCTURED_ERROR
from updraft.outputs import RequestOutput, merge_outputs
from updraft.sampling_params import SamplingParams
from updraft.serve.engine_client import EngineClient, EngineDeadError, ShuttingDownError
from updraft.serve.engine_core import EngineInfo
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
    PromptLogprob,
    PromptLogprobs,
    StreamOptions,
    TopLogprob,
    Usage,
    new_id,
    now,
)
from updraft.serve.tool_parsers import ReplyStream, parse, reply_stream
from updraft.serve.tools import CallStream, default_parser
from updraft.tokenizer import Tokenizer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
# Threads that tokenize prompts and render chat templates: half the cores, so that the
# engine keeps the rest however many clients send huge prompts.
PREPARE_THREADS = max(1, (os.cpu_count() or 2) // 2)
T = TypeVar("T")


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
        self,
        engine: EngineClient,
        info: EngineInfo,
        settings: ServeSettings,
        chat_template: ChatTemplate,
    ) -> None:
        self.engine = engine
        self.info = info
        self.settings = settings
        self.chat_template = chat_template
        # Intake (engine/input_processor.py), the same as LLM's, run here: the engine core
        # receives finished requests and never tokenizes.
        self.processor = InputProcessor(engine.tokenizer, info, chat_template)
        self.tool_parser = settings.tool_call_parser or default_parser(chat_template.source)
        self.tokenizer: Tokenizer | None = engine.tokenizer
        self.max_model_len = info.max_model_len
        # The engine compiles each spec again in its own process; this one makes a spec
        # that cannot compile a 400 naming its field, before the request is admitted.
        self._compiler = (
            None
            if self.tokenizer is None
            else GrammarCompiler.for_model(
                info.model, info.vocab_size, self.tokenizer, info.eos_token_ids
            )
        )
        self.max_tokens_limit = settings.max_tokens_limit or self.max_model_len
        # Tokenizing and template rendering run in these threads, never on the event
        # loop, and no more of them than this at once: a flood of huge prompts then
        # waits its turn instead of taking every core from the engine.
        self._workers = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="updraft-prepare")
        # A longer text cannot fit in the context whatever it tokenizes to: refused
        # before any tokenizing.
        self.max_prompt_chars = (
            None if self.tokenizer is None else self.max_model_len * self.tokenizer.max_token_chars
        )

    async def _off_loop(self, function: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._workers, function, *args)

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)
        if self._compiler is not None:
            self._compiler.close()

    # -- the two endpoints ---------------------------------------------------------------

    async def completion(self, body: CompletionRequest) -> JSONResponse | StreamingResponse:
        self._check_model(body.model)
        body.check_supported()
        explicit = body.requested_max_tokens() is not None
        params = body.sampling_params(
            COMPLETIONS_DEFAULT_MAX_TOKENS,
            self.max_tokens_limit,
            False if body.logprobs is None else body.logprobs,
        )
        structured_field = body.structured_outputs_field()
        await self._compile(params, structured_field)
        intakes = [await self._intake(prompt, params, "prompt") for prompt in body.prompts()]
        request_id = new_id("cmpl")
        streams = await self._start_all(
            request_id,
            intakes,
            explicit,
            body.max_tokens_field(),
            "prompt",
            structured_field,
        )
        heads = [
            self._head(body, position, text, first)
            for position, (text, (_, first)) in enumerate(zip(body.prompts(), streams, strict=True))
        ]
        options = body.stream_options or StreamOptions()
        if body.stream:
            events = self._completion_events(
                request_id, body.model, streams, body.n, options, body.return_token_ids, heads
            )
            return ClosingStreamingResponse(_sse(events), media_type="text/event-stream")
        finals = await _finals(streams)
        choices = []
        for head, final in zip(heads, finals, strict=True):
            for completion in final.outputs:
                logprobs = self._completion_logprobs(
                    completion.token_ids,
                    completion.logprobs,
                    completion.top_logprobs,
                    len(head.text),
                )
                choices.append(
                    CompletionChoice(
                        index=head.position * body.n + completion.index,
                        text=head.text + completion.text,
                        logprobs=_joined(head.logprobs, logprobs),
                        finish_reason=completion.finish_reason,
                        token_ids=list(completion.token_ids) if body.return_token_ids else None,
                        prompt_logprobs=head.prompt_logprobs,
                    )
                )
        response = CompletionResponse(
            id=request_id, created=now(), model=body.model, choices=choices, usage=_usage(finals)
        )
        return JSONResponse(response.model_dump())

    async def chat(self, body: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
        self._check_model(body.model)
        body.check_supported()
        explicit = body.requested_max_tokens() is not None
        params = body.sampling_params(
            self.max_tokens_limit, self.max_tokens_limit, body.logprobs_asked()
        )
        structured_field = "tools" if body.calls_required() else body.structured_outputs_field()
        await self._compile(params, structured_field)
        messages = [m.for_template() for m in body.messages]
        try:
            # Off the event loop: a template over a megabyte of messages takes a while.
            prompt = await self._off_loop(
                self.processor.render_chat,
                messages,
                body.add_generation_prompt,
                body.chat_template_kwargs,
                body.template_tools(),
                body.continue_final_message,
            )
        except ChatTemplateError as error:
            raise APIError(400, f"messages: {error}", param="messages") from error
        intake = await self._intake(prompt, params, "messages")
        request_id = new_id("chatcmpl")
        streams = await self._start_all(
            request_id,
            [intake],
            explicit,
            body.max_tokens_field(),
            "messages",
            structured_field,
        )
        options = body.stream_options or StreamOptions()
        if body.stream:
            events = self._chat_events(request_id, body, streams, options)
            return ClosingStreamingResponse(_sse(events), media_type="text/event-stream")
        finals = await _finals(streams)
        choices = []
        for completion in finals[0].outputs:
            logprobs = None
            if body.logprobs:
                logprobs = self._chat_logprobs(
                    completion.token_ids, completion.logprobs, completion.top_logprobs
                )
            content, calls = completion.text, []
            replies = self._reply_stream(body)
            if replies is not None:
                content, calls = parse(replies, completion.text)
            choices.append(
                ChatChoice(
                    index=completion.index,
                    message=ChatResponseMessage(
                        content=content if content.strip() or not calls else None,
                        tool_calls=[call.to_openai() for call in calls] or None,
                    ),
                    logprobs=logprobs,
                    finish_reason=_finish_reason(completion.finish_reason, bool(calls)),
                )
            )
        response = ChatCompletionResponse(
            id=request_id,
            created=now(),
            model=body.model,
            choices=choices,
            usage=_usage(finals),
            prompt_logprobs=self._prompt_logprobs(finals[0]),
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
        that one that cannot compile is a 400 naming ``field``."""
        spec = params.structured_outputs
        if spec is None:
            return
        compiler = self._compiler
        if compiler is None:
            raise APIError(
                400, f"{field}: structured outputs need the model's tokenizer", param=field
            )
        try:
            await asyncio.wrap_future(compiler.submit(spec))
        except GrammarError as error:
            raise APIError(400, f"{field}: {error.detail}", param=field) from error

    async def _intake(
        self, prompt: str | list[int], params: SamplingParams, field: str
    ) -> EngineRequest:
        """The prompt through intake; a text is tokenized in a worker thread: the engine
        thread, which steps every running request, never tokenizes, and a long text is
        encoded without the GIL (``Tokenizer.encode``). A text too long for any context
        is refused unread."""
        if isinstance(prompt, list) or self.tokenizer is None:
            return self.processor.process(prompt, params)
        if len(prompt) > self.max_prompt_chars:
            raise APIError(
                400,
                f"{field}: {len(prompt)} characters are more than {self.max_model_len} tokens, "
                "the context length, can hold",
                param=field,
            )
        return await self._off_loop(self.processor.process, prompt, params)

    async def _start(
        self,
        request_id: str,
        intake: EngineRequest,
        field: str,
        structured_field: str | None = None,
    ) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
        """Admit the request and wait for its first output; a prompt intake refused is a
        400 naming ``field``, a grammar that failed as it ran one naming
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
        if intake.error is not None:
            raise _refusal(intake.error, field, None)
        outputs = self.engine.generate(request_id, intake)
        try:
            first = await anext(outputs)
        except ShuttingDownError as error:
            raise APIError(503, str(error), headers={"Retry-After": "5"}) from error
        except EngineDeadError as error:
            raise APIError(503, str(error)) from error
        if first.error is not None:
            await outputs.aclose()
            raise _refusal(first.error, field, structured_field)
        return outputs, first

    async def _start_all(
        self,
        request_id: str,
        intakes: list[EngineRequest],
        explicit: bool,
        max_tokens_field: str,
        field: str,
        structured_field: str | None,
    ) -> list[Started]:
        """Start one engine request per prompt (each with ``params.n`` sequences); the
        first refused ends those already started and is the request's 400."""
        started: list[Started] = []
        try:
            for i, intake in enumerate(intakes):
                fitted = self._fitted(intake, explicit, max_tokens_field)
                suffix = "" if len(intakes) == 1 else f"-{i}"
                started.append(
                    await self._start(request_id + suffix, fitted, field, structured_field)
                )
        except BaseException:
            for outputs, _ in started:
                await outputs.aclose()
            raise
        return started

    def _fitted(self, intake: EngineRequest, explicit: bool, field: str) -> EngineRequest:
        """``intake`` with max_tokens within the context after the prompt: a max_tokens
        the client gave that does not fit is a 400 naming both numbers; the default one
        is cut to fit."""
        params = intake.params
        if intake.error is not None:
            return intake  # refused in _start, naming the prompt's field
        num_prompt = len(intake.prompt_token_ids)  # truncated already
        room = self.max_model_len - num_prompt
        if params.max_tokens <= room:
            return intake
        if explicit:
            raise APIError(
                400,
                f"{field}: the prompt's {num_prompt} tokens plus {field}={params.max_tokens} "
                f"are more than the context length of {self.max_model_len} tokens",
                param=field,
            )
        fitted = replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        return replace(intake, params=fitted)

    def _head(
        self, body: CompletionRequest, position: int, prompt: str | list[int], first: RequestOutput
    ) -> PromptHead:
        """What each choice of the prompt at ``position`` starts with: the echoed prompt
        (the client's text, or its kept tokens decoded) and its logprobs, and the
        prompt's logprobs."""
        text, logprobs = "", None
        if body.echo:
            if isinstance(prompt, str) and body.truncate_prompt_tokens is None:
                text = prompt
            elif self.tokenizer is not None:
                text = self.tokenizer.decode(first.prompt_token_ids, skip_special_tokens=False)
            if body.logprobs is not None:
                logprobs = self._echo_logprobs(
                    first.prompt_token_ids, first.prompt_logprobs, body.logprobs
                )
        scored = self._prompt_logprobs(first) if body.prompt_logprobs is not None else None
        return PromptHead(position, text, logprobs, scored)

    def _prompt_logprobs(self, output: RequestOutput) -> PromptLogprobs | None:
        if output.prompt_logprobs is None:
            return None
        return [
            None
            if entry is None
            else {
                str(token): PromptLogprob(logprob=value, decoded_token=self._token_text(token))
                for token, value in entry.items()
            }
            for entry in output.prompt_logprobs
        ]

    def _echo_logprobs(
        self, prompt_ids: list[int], scored: list[dict[int, float] | None], k: int
    ) -> CompletionLogprobs:
        """The echoed prompt's tokens as completions logprobs: none for the first token,
        then each token's and its position's k likeliest."""
        logprobs = [None] + [e[t] for e, t in zip(scored[1:], prompt_ids[1:], strict=True)]
        top = None
        if k:  # a position's entry holds its own token first, then the likeliest
            top = [None] + [dict(sorted(e.items(), key=lambda i: -i[1])[:k]) for e in scored[1:]]
        return self._completion_logprobs(prompt_ids, logprobs, top)

    async def _completion_events(
        self,
        request_id: str,
        model: str,
        streams: list[Started],
        n: int,
        options: StreamOptions,
        return_token_ids: bool,
        heads: list[PromptHead],
    ) -> AsyncIterator[str]:
        created = now()
        want_logprobs = streams[0][1].outputs[0].logprobs is not None
        every_token = want_logprobs or return_token_ids
        offsets: dict[int, int] = {}
        usage = UsageSoFar()
        async with aclosing(_merged(streams)) as merged:
            async for i, output in merged:
                completion = output.outputs[0]
                index = i * n + completion.index
                usage.record(i, index, output)
                text = completion.delta_text
                opening = index not in offsets  # the choice's first chunk carries the head
                if opening:
                    text = heads[i].text + text
                if not (text or completion.finish_reason or every_token):
                    continue  # text held back: a possible stop string or a partial character
                offset = offsets.get(index, 0)
                logprobs = None
                if want_logprobs and completion.delta_token_ids:
                    logprobs = self._completion_logprobs(
                        completion.delta_token_ids,
                        completion.delta_logprobs,
                        completion.delta_top_logprobs,
                        offset + len(text) - len(completion.delta_text),
                    )
                if opening:
                    logprobs = _joined(heads[i].logprobs, logprobs)
                offsets[index] = offset + len(text)
                choice = CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    token_ids=list(completion.delta_token_ids) if return_token_ids else None,
                    prompt_logprobs=heads[i].prompt_logprobs if opening else None,
                )
                chunk = CompletionResponse(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[choice],
                    usage=usage.total() if options.continuous_usage_stats else None,
                )
                yield _event(chunk.model_dump())
        if options.include_usage:
            last = CompletionResponse(
                id=request_id, created=created, model=model, choices=[], usage=usage.total()
            )
            yield _event(last.model_dump())

    async def _chat_events(
        self,
        request_id: str,
        body: ChatCompletionRequest,
        streams: list[Started],
        options: StreamOptions,
    ) -> AsyncIterator[str]:
        created = now()
        want_logprobs = streams[0][1].outputs[0].logprobs is not None
        replies: dict[int, ReplyStream | None] = {}
        called: set[int] = set()
        usage = UsageSoFar()

        def chunk(
            index: int, delta: ChatDelta, finish_reason: str | None, logprobs=None, scored=None
        ) -> str:
            choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason)
            choice.logprobs = logprobs
            body_ = ChatCompletionChunk(
                id=request_id,
                created=created,
                model=body.model,
                choices=[choice],
                usage=usage.total() if options.continuous_usage_stats else None,
                prompt_logprobs=scored,
            ).model_dump()
            for item in body_["choices"]:  # a delta names only what it changes
                item["delta"] = {k: v for k, v in item["delta"].items() if v is not None}
            return _event(body_)

        scored = self._prompt_logprobs(streams[0][1])  # complete with the first output
        for index in range(body.n):
            role = ChatDelta(role="assistant", content="")
            yield chunk(index, role, None, scored=scored if index == 0 else None)
        async with aclosing(_merged(streams)) as merged:
            async for i, output in merged:
                completion = output.outputs[0]
                index = completion.index
                usage.record(i, index, output)
                if not (completion.delta_text or completion.finish_reason or want_logprobs):
                    continue
                logprobs = None
                if want_logprobs and completion.delta_token_ids:
                    logprobs = self._chat_logprobs(
                        completion.delta_token_ids,
                        completion.delta_logprobs,
                        completion.delta_top_logprobs,
                    )
                text, tool_calls = completion.delta_text, None
                if index not in replies:
                    replies[index] = self._reply_stream(body)
                parser = replies[index]
                if parser is not None:  # calls taken out of the text
                    reply = parser.feed(text)
                    if completion.finish_reason is not None:
                        reply = reply + parser.finish()
                    text, tool_calls = reply.content, reply.tool_calls or None
                    if tool_calls:
                        called.add(index)
                    finish = completion.finish_reason
                    if not (text or tool_calls or finish or want_logprobs):
                        continue
                delta = ChatDelta(content=text or None, tool_calls=tool_calls)
                finish_reason = _finish_reason(completion.finish_reason, index in called)
                yield chunk(index, delta, finish_reason, logprobs)
        if options.include_usage:
            last = ChatCompletionChunk(
                id=request_id, created=created, model=body.model, choices=[], usage=usage.total()
            )
            yield _event(last.model_dump())

    # -- logprobs ------------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer else str(token_id)

    def _completion_logprobs(
        self,
        token_ids: Sequence[int],
        logprobs: list[float | None] | None,
        top: list[dict[int, float] | None] | None,
        offset: int = 0,
    ) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        tokens = [self._token_text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top_logprobs = None
        if top is not None:
            top_logprobs = [
                None if row is None else {self._token_text(t): lp for t, lp in row.items()}
                for row in top
            ]
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=list(logprobs),
            top_logprobs=top_logprobs,
            text_offset=offsets,
        )

    def _chat_logprobs(
        self,
        token_ids: Sequence[int],
        logprobs: list[float] | None,
        top: list[dict[int, float]] | None,
    ) -> ChatChoiceLogprobs | None:
        if logprobs is None:
            return None
        content = []
        for position, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
            text = self._token_text(token_id)
            alternatives = []
            for other, other_logprob in (top[position] if top else {}).items():
                other_text = self._token_text(other)
                alternatives.append(
                    TopLogprob(
                        token=other_text,
                        logprob=other_logprob,
                        bytes=list(other_text.encode("utf-8")),
                    )
                )
            content.append(
                ChatLogprob(
                    token=text,
                    logprob=logprob,
                    bytes=list(text.encode("utf-8")),
                    top_logprobs=alternatives,
                )
            )
        return ChatChoiceLogprobs(content=content)


Started = tuple[AsyncIterator[RequestOutput], RequestOutput]  # the outputs, the first one


@dataclass(frozen=True)
class PromptHead:
    """What every choice of one prompt of a completions request starts with."""

    position: int  # the prompt's, among the request's prompts
    text: str  # the echoed prompt, or nothing
    logprobs: CompletionLogprobs | None  # the echoed prompt's, with echo and logprobs
    prompt_logprobs: PromptLogprobs | None  # vLLM's prompt_logprobs field


def _joined(
    first: CompletionLogprobs | None, second: CompletionLogprobs | None
) -> CompletionLogprobs | None:
    """Two runs of completions logprobs as one (the echoed prompt's, then the output's)."""
    if first is None or second is None:
        return first or second
    top = None
    if first.top_logprobs is not None or second.top_logprobs is not None:
        top = (first.top_logprobs or [None] * len(first.tokens)) + (
            second.top_logprobs or [None] * len(second.tokens)
        )
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=top,
        text_offset=first.text_offset + second.text_offset,
    )


class UsageSoFar:
    """Tokens so far over a request's prompts and choices: each prompt counted once,
    whatever its n."""

    def __init__(self) -> None:
        self.prompts: dict[int, int] = {}
        self.outputs: dict[int, int] = {}

    def record(self, prompt: int, choice: int, output: RequestOutput) -> None:
        self.prompts[prompt] = output.metrics.num_prompt_tokens
        self.outputs[choice] = output.metrics.num_output_tokens

    def total(self) -> Usage:
        prompt, completion = sum(self.prompts.values()), sum(self.outputs.values())
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )


async def _sse(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, then ``[DONE]``. The status line has gone out before the first
    event, so an engine failure mid-stream becomes an error event."""
    async with aclosing(events):
        try:
            async for event in events:
                yield event
        except (EngineDeadError, ShuttingDownError) as error:
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


async def _merged(streams: list[Started]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every prompt's outputs as they come, with the prompt's position; closing it
    aborts whatever has not finished."""
    if len(streams) == 1:
        outputs, first = streams[0]
        async with aclosing(_chain(first, outputs)) as stream:
            async for output in stream:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(position: int, outputs: AsyncIterator[RequestOutput], first) -> None:
        try:
            async with aclosing(_chain(first, outputs)) as stream:
                async for output in stream:
                    queue.put_nowait((position, output))
        except Exception as error:  # a dead engine: the merged stream raises it
            queue.put_nowait((position, error))
        finally:
            queue.put_nowait((position, None))

    tasks = [asyncio.create_task(pump(i, *started)) for i, started in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            position, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _finals(streams: list[Started]) -> list[RequestOutput]:
    """Per prompt, its outputs to the end as one (n completions in index order)."""
    latest: list[dict[int, RequestOutput]] = [{} for _ in streams]
    try:
        async with aclosing(_merged(streams)) as merged:
            async for position, output in merged:
                latest[position][output.outputs[0].index] = output
    except (EngineDeadError, ShuttingDownError) as error:
        raise APIError(503, str(error)) from error
    return [merge_outputs(list(outputs.values())) for outputs in latest]


def _refusal(error: str, field: str, structured_field: str | None) -> APIError:
    """The 400 for a request the engine or intake refused, naming the field at fault."""
    if structured_field is not None and error.startswith(STRUCTURED_ERROR):
        field, error = structured_field, error.removeprefix(STRUCTURED_ERROR)
    message = error if error.startswith(field) else f"{field}: {error}"
    return APIError(400, message, param=field)


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's tool_calls where a reply that made calls ended on its own."""
    return "tool_calls" if called and reason == "stop" else reason


def _usage(finals: list[RequestOutput]) -> Usage:
    prompt = sum(final.metrics.num_prompt_tokens for final in finals)
    completion = sum(final.metrics.num_output_tokens for final in finals)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
