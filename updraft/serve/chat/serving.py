"""/v1/chat/completions: from a validated request to a response or a stream of events.

The conversation is rendered with the chat template (off the event loop), then goes
through intake like any prompt. Tool calls are read out of each reply by one stream
object (serve/parsers), fed the reply's text whether it is streamed or not, so a whole
response and a stream cannot disagree.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from fastapi.responses import JSONResponse
from starlette.responses import StreamingResponse

from updraft.chat_template import ChatTemplateError
from updraft.outputs import CompletionOutput, RequestOutput
from updraft.serve.chat.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprob,
    ChatResponseMessage,
    NamedToolChoice,
    TopLogprob,
)
from updraft.serve.errors import APIError
from updraft.serve.parsers.tool_parsers import ReplyStream, parse, reply_stream
from updraft.serve.parsers.tools import CallStream, default_parser
from updraft.serve.protocol import PromptLogprobs, StreamOptions, new_id, now
from updraft.serve.serving import ServingBase
from updraft.serve.streams import (
    ClosingStreamingResponse,
    Started,
    UsageSoFar,
    final_outputs,
    merged_outputs,
    sse,
    sse_event,
    usage_of,
)


class ChatServing:
    def __init__(self, base: ServingBase) -> None:
        self.base = base
        self.tool_parser = base.settings.tool_call_parser or default_parser(
            base.processor.chat_template.source
        )

    async def create(self, body: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
        base = self.base
        base.check_model(body.model)
        body.check_supported()
        explicit = body.requested_max_tokens() is not None
        params = body.sampling_params(
            base.max_tokens_limit, base.max_tokens_limit, body.logprobs_asked()
        )
        structured_field = "tools" if body.calls_required() else body.structured_outputs_field()
        await base.compile(params, structured_field)
        intake = await base.intake(await self._render(body), params, "messages")
        request_id = new_id("chatcmpl")
        streams = await base.start_all(
            request_id, [intake], explicit, body.max_tokens_field(), "messages", structured_field
        )
        if body.stream:
            options = body.stream_options or StreamOptions()
            events = ChatEvents(self, request_id, body, streams, options).events()
            return ClosingStreamingResponse(sse(events), media_type="text/event-stream")
        return await self._response(request_id, body, streams)

    async def _render(self, body: ChatCompletionRequest) -> str:
        """The conversation as the prompt text, rendered off the event loop: a template
        over a megabyte of messages takes a while."""
        messages = [m.for_template() for m in body.messages]
        try:
            return await self.base.off_loop(
                self.base.processor.render_chat,
                messages,
                body.add_generation_prompt,
                body.chat_template_kwargs,
                body.template_tools(),
                body.continue_final_message,
            )
        except ChatTemplateError as error:
            raise APIError(400, f"messages: {error}", param="messages") from error

    async def _response(
        self, request_id: str, body: ChatCompletionRequest, streams: list[Started]
    ) -> JSONResponse:
        """The whole response, once every choice has finished."""
        finals = await final_outputs(streams)
        choices = [self._choice(body, completion) for completion in finals[0].outputs]
        response = ChatCompletionResponse(
            id=request_id,
            created=now(),
            model=body.model,
            choices=choices,
            usage=usage_of(finals),
            prompt_logprobs=self.base.prompt_logprobs(finals[0]),
        )
        return JSONResponse(response.model_dump())

    def _choice(self, body: ChatCompletionRequest, completion: CompletionOutput) -> ChatChoice:
        logprobs = None
        if body.logprobs:
            logprobs = self.logprobs(
                completion.token_ids, completion.logprobs, completion.top_logprobs
            )
        content, calls = completion.text, []
        replies = self.reply_stream(body)
        if replies is not None:
            content, calls = parse(replies, completion.text)
        return ChatChoice(
            index=completion.index,
            message=ChatResponseMessage(
                content=content if content.strip() or not calls else None,
                tool_calls=[call.to_openai() for call in calls] or None,
            ),
            logprobs=logprobs,
            finish_reason=finish_reason(completion.finish_reason, bool(calls)),
        )

    def reply_stream(self, body: ChatCompletionRequest) -> ReplyStream | None:
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

    def logprobs(
        self,
        token_ids: Sequence[int],
        logprobs: list[float] | None,
        top: list[dict[int, float]] | None,
    ) -> ChatChoiceLogprobs | None:
        if logprobs is None:
            return None
        token_text = self.base.token_text
        content = []
        for position, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
            text = token_text(token_id)
            alternatives = []
            for other, other_logprob in (top[position] if top else {}).items():
                other_text = token_text(other)
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


class ChatEvents:
    """One streamed chat response: a role chunk per choice, then a chunk for each output
    with news (tool calls taken out of the text), then the usage if asked."""

    def __init__(
        self,
        serving: ChatServing,
        request_id: str,
        body: ChatCompletionRequest,
        streams: list[Started],
        options: StreamOptions,
    ) -> None:
        self.serving = serving
        self.request_id = request_id
        self.body = body
        self.streams = streams
        self.options = options
        self.created = now()
        self.want_logprobs = streams[0][1].outputs[0].logprobs is not None
        self.replies: dict[int, ReplyStream | None] = {}
        self.called: set[int] = set()
        self.usage = UsageSoFar()

    async def events(self) -> AsyncIterator[str]:
        body = self.body
        scored = self.serving.base.prompt_logprobs(self.streams[0][1])  # complete with the first
        for index in range(body.n):
            role = ChatDelta(role="assistant", content="")
            yield self._chunk(index, role, None, scored=scored if index == 0 else None)
        async with aclosing(merged_outputs(self.streams)) as merged:
            async for i, output in merged:
                event = self._event(i, output)
                if event is not None:
                    yield event
        if self.options.include_usage:
            last = ChatCompletionChunk(
                id=self.request_id,
                created=self.created,
                model=body.model,
                choices=[],
                usage=self.usage.total(),
            )
            yield sse_event(last.model_dump())

    def _event(self, i: int, output: RequestOutput) -> str | None:
        """The chunk for one output of choice ``index``, or None when it has no news."""
        completion = output.outputs[0]
        index = completion.index
        self.usage.record(i, index, output)
        want_logprobs = self.want_logprobs
        if not (completion.delta_text or completion.finish_reason or want_logprobs):
            return None
        logprobs = None
        if want_logprobs and completion.delta_token_ids:
            logprobs = self.serving.logprobs(
                completion.delta_token_ids,
                completion.delta_logprobs,
                completion.delta_top_logprobs,
            )
        text, tool_calls = completion.delta_text, None
        if index not in self.replies:
            self.replies[index] = self.serving.reply_stream(self.body)
        parser = self.replies[index]
        if parser is not None:  # calls taken out of the text
            reply = parser.feed(text)
            if completion.finish_reason is not None:
                reply = reply + parser.finish()
            text, tool_calls = reply.content, reply.tool_calls or None
            if tool_calls:
                self.called.add(index)
            if not (text or tool_calls or completion.finish_reason or want_logprobs):
                return None
        delta = ChatDelta(content=text or None, tool_calls=tool_calls)
        reason = finish_reason(completion.finish_reason, index in self.called)
        return self._chunk(index, delta, reason, logprobs)

    def _chunk(
        self,
        index: int,
        delta: ChatDelta,
        reason: str | None,
        logprobs: ChatChoiceLogprobs | None = None,
        scored: PromptLogprobs | None = None,
    ) -> str:
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=reason)
        choice.logprobs = logprobs
        payload = ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.body.model,
            choices=[choice],
            usage=self.usage.total() if self.options.continuous_usage_stats else None,
            prompt_logprobs=scored,
        ).model_dump()
        for item in payload["choices"]:  # a delta names only what it changes
            item["delta"] = {k: v for k, v in item["delta"].items() if v is not None}
        return sse_event(payload)


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's tool_calls where a reply that made calls ended on its own."""
    return "tool_calls" if called and reason == "stop" else reason
