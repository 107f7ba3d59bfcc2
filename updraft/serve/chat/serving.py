"""/v1/chat/completions: from a validated request to a response or a stream of events.

The conversation is rendered with the chat template (off the event loop), then goes
through intake like any prompt. Reasoning and tool calls are read out of each reply by
one reader (serve/parsers/reply.py), fed the reply's text whether it is streamed or not,
so a whole response and a stream cannot disagree.

With a reasoning parser, a grammar (a response_format, a required tool call) constrains
only the answer: it starts once the reply has written the end of its reasoning. A reply
the model would open reasoning in itself gets the opening tag in its prompt instead, so
that the grammar knows where it stands from the first token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import replace

from fastapi.responses import JSONResponse
from starlette.responses import StreamingResponse

from updraft.chat_template import ChatTemplateError
from updraft.outputs import CompletionOutput, RequestOutput
from updraft.sampling_params import SamplingParams
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
from updraft.serve.parsers.harmony import HarmonyReader, control_token_in, is_harmony
from updraft.serve.parsers.harmony_grammar import call_spec, final_answer_spec
from updraft.serve.parsers.reasoning import (
    REASONING_PARSERS,
    ReasoningStream,
    Start,
    default_reasoning,
    reply_start,
)
from updraft.serve.parsers.reply import ReplyReader
from updraft.serve.parsers.tool_parsers import ReplyStream, reply_stream
from updraft.serve.parsers.tools import CallStream, default_parser
from updraft.serve.protocol import PromptLogprobs, StreamOptions, new_id, now
from updraft.serve.serving import ServingBase, refuse_failed_grammar
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
        source = base.processor.chat_template.source
        self.tool_parser = base.settings.tool_call_parser or default_parser(source)
        reasoning = base.settings.reasoning_parser or default_reasoning(source)
        # Harmony's channels carry reasoning and calls alike: one reader for both.
        self.harmony = is_harmony(source)
        self.reasoning_tags = None if self.harmony else REASONING_PARSERS.get(reasoning or "none")

    async def create(self, body: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
        base = self.base
        base.check_model(body.model)
        body.check_supported()
        explicit = body.requested_max_tokens() is not None
        params = body.sampling_params(
            base.max_tokens_limit, base.max_tokens_limit, body.logprobs_asked()
        )
        structured_field = body.constraint_field()
        if self.harmony:
            params = self._harmony(params, body)
        await base.compile(params, structured_field)
        prompt, start, params = self._reasoning(await self._render(body), params, body)
        if self.tool_parser == "mistral" and self.reply_stream(body) is not None:
            # Mistral's [TOOL_CALLS] is a special token: kept in the text to be read.
            params = replace(params, skip_special_tokens=False)
        special = base.processor.chat_adds_special_tokens
        intake = await base.intake(prompt, params, "messages", special)
        request_id = new_id("chatcmpl")
        streams = await base.start_all(
            request_id, [intake], explicit, body.max_tokens_field(), "messages", structured_field
        )
        if body.stream:
            options = body.stream_options or StreamOptions()
            events = ChatEvents(self, request_id, body, streams, options, start).events()
            return ClosingStreamingResponse(sse(events), media_type="text/event-stream")
        return await self._response(request_id, body, streams, start)

    def _harmony(self, params: SamplingParams, body: ChatCompletionRequest) -> SamplingParams:
        """Harmony's markers kept in the text, to be read; a grammar set to constrain the
        answer, not the analysis (harmony_grammar.py). A request that writes a marker
        itself is refused: the tokenizer would read it as one, letting a message's text
        open a message of another role."""
        for field, value in body.prompt_text_fields():
            marker = control_token_in(value)
            if marker is not None:
                raise APIError(
                    400,
                    f"{field}: contains {marker}, one of the chat format's control tokens",
                    param=field.split("[")[0],
                )
        spec = params.structured_outputs
        try:
            if body.calls_required():
                choice = body.effective_tool_choice()
                named = choice.function.name if isinstance(choice, NamedToolChoice) else None
                spec = call_spec(body.template_tools() or [], named)
            elif spec is not None and not self.base.settings.structured_outputs_in_reasoning:
                backend = self.base.tokenizer.backend
                spec = final_answer_spec(
                    spec, lambda text: backend.encode(text, add_special_tokens=False).ids
                )
        except ValueError as error:  # a grammar past the size a spec may have
            field = body.constraint_field()
            message = str(error).removeprefix("structured_outputs")
            raise APIError(400, f"{field}{message}", param=field) from error
        return replace(params, skip_special_tokens=False, structured_outputs=spec)

    def _reasoning(
        self, prompt: str, params: SamplingParams, body: ChatCompletionRequest
    ) -> tuple[str, Start | None, SamplingParams]:
        """The prompt, where its reply starts with respect to reasoning (None without a
        reasoning parser), and the params with any grammar set to start after it. A
        continued final message is not opened: its grammar applies from the start."""
        tags = self.reasoning_tags
        if tags is None:
            return prompt, None, params
        start = reply_start(prompt, tags)
        spec = params.structured_outputs
        if (
            spec is None
            or start is Start.AFTER
            or self.base.settings.structured_outputs_in_reasoning
            or (start is Start.MAYBE and body.continue_final_message)
        ):
            return prompt, start, params
        if start is Start.MAYBE:
            prompt, start = prompt + tags[0], Start.INSIDE
        # The closing tag as the tokenizer spells it: one added token in the families that
        # think (Qwen3, DeepSeek-R1), which is how their models write it.
        tokenizer = self.base.tokenizer
        closing = tuple(tokenizer.backend.encode(tags[1], add_special_tokens=False).ids)
        return (
            prompt,
            start,
            replace(params, structured_outputs=replace(spec, starts_after=closing)),
        )

    async def _render(self, body: ChatCompletionRequest) -> str:
        """The conversation as the prompt text, rendered off the event loop: a template
        over a megabyte of messages takes a while."""
        messages = [m.for_template() for m in body.messages]
        tools = body.template_tools()
        if self.harmony and tools:
            # gpt-oss's template writes every tool's description; OpenAI's is optional.
            tools = [{**t, "function": {"description": "", **t["function"]}} for t in tools]
        try:
            return await self.base.off_loop(
                self.base.processor.render_chat,
                messages,
                body.add_generation_prompt,
                body.template_variables(),
                tools,
                body.continue_final_message,
            )
        except ChatTemplateError as error:
            raise APIError(400, f"messages: {error}", param="messages") from error

    async def _response(
        self,
        request_id: str,
        body: ChatCompletionRequest,
        streams: list[Started],
        start: Start | None,
    ) -> JSONResponse:
        """The whole response, once every choice has finished."""
        finals = await final_outputs(streams)
        structured_field = body.constraint_field()
        refuse_failed_grammar(finals, "messages", structured_field)
        choices = [self._choice(body, completion, start) for completion in finals[0].outputs]
        response = ChatCompletionResponse(
            id=request_id,
            created=now(),
            model=body.model,
            choices=choices,
            usage=usage_of(finals),
            prompt_logprobs=self.base.prompt_logprobs(finals[0]),
        )
        return JSONResponse(response.model_dump())

    def _choice(
        self, body: ChatCompletionRequest, completion: CompletionOutput, start: Start | None
    ) -> ChatChoice:
        logprobs = None
        if body.logprobs:
            logprobs = self.logprobs(
                completion.token_ids, completion.logprobs, completion.top_logprobs
            )
        reader = self.reply_reader(body, start)
        reply = reader.read_all(completion.text, cut=completion.finish_reason == "length")
        content, calls = reply.content, reader.calls
        return ChatChoice(
            index=completion.index,
            message=ChatResponseMessage(
                content=content if content.strip() or not (calls or reply.reasoning) else None,
                tool_calls=[call.to_openai() for call in calls] or None,
                reasoning_content=reply.reasoning or None,
            ),
            logprobs=logprobs,
            finish_reason=finish_reason(completion.finish_reason, bool(calls)),
        )

    def reply_reader(
        self, body: ChatCompletionRequest, start: Start | None
    ) -> ReplyReader | HarmonyReader:
        """What reads one choice's reply: harmony's channels, or its reasoning where the
        server has a reasoning parser (``start``: where the reply starts), then its tool
        calls."""
        if self.harmony:
            return HarmonyReader([tool["function"]["name"] for tool in body.template_tools() or []])
        reasoning = None if start is None else ReasoningStream(self.reasoning_tags, start)
        return ReplyReader(reasoning, self.reply_stream(body))

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
        start: Start | None,
    ) -> None:
        self.serving = serving
        self.start = start
        self.request_id = request_id
        self.body = body
        self.streams = streams
        self.options = options
        self.created = now()
        self.want_logprobs = streams[0][1].outputs[0].logprobs is not None
        self.replies: dict[int, ReplyReader | HarmonyReader] = {}
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
        if index not in self.replies:
            self.replies[index] = self.serving.reply_reader(self.body, self.start)
        reader = self.replies[index]  # reasoning and calls taken out of the text
        reply = reader.feed(completion.delta_text)
        if completion.finish_reason is not None:
            reply = reply + reader.finish(cut=completion.finish_reason == "length")
        text, tool_calls, reasoning = reply.content, reply.tool_calls or None, reply.reasoning
        if tool_calls:
            self.called.add(index)
        if not (text or tool_calls or reasoning or completion.finish_reason or want_logprobs):
            return None
        delta = ChatDelta(
            content=text or None, tool_calls=tool_calls, reasoning_content=reasoning or None
        )
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
