"""/v1/completions: from a validated request to a response or a stream of events.

A completions request may hold several prompts: each is its own engine request (with
its n sequences), and its choices are numbered after the prompts before it. With
``echo`` each choice starts with its prompt (``PromptHead``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from starlette.responses import StreamingResponse

from updraft.outputs import RequestOutput
from updraft.serve.completions.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
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

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


class CompletionServing:
    def __init__(self, base: ServingBase) -> None:
        self.base = base

    async def create(self, body: CompletionRequest) -> JSONResponse | StreamingResponse:
        base = self.base
        base.check_model(body.model)
        body.check_supported()
        explicit = body.requested_max_tokens() is not None
        params = body.sampling_params(
            COMPLETIONS_DEFAULT_MAX_TOKENS,
            base.max_tokens_limit,
            False if body.logprobs is None else body.logprobs,
        )
        structured_field = body.structured_outputs_field()
        await base.compile(params, structured_field)
        intakes = [await base.intake(prompt, params, "prompt") for prompt in body.prompts()]
        request_id = new_id("cmpl")
        streams = await base.start_all(
            request_id, intakes, explicit, body.max_tokens_field(), "prompt", structured_field
        )
        heads = [
            self._head(body, position, text, first)
            for position, (text, (_, first)) in enumerate(zip(body.prompts(), streams, strict=True))
        ]
        if body.stream:
            options = body.stream_options or StreamOptions()
            events = self._events(
                request_id, body.model, streams, body.n, options, body.return_token_ids, heads
            )
            return ClosingStreamingResponse(sse(events), media_type="text/event-stream")
        return await self._response(request_id, body, streams, heads)

    async def _response(
        self,
        request_id: str,
        body: CompletionRequest,
        streams: list[Started],
        heads: list[PromptHead],
    ) -> JSONResponse:
        """The whole response, once every choice has finished."""
        finals = await final_outputs(streams)
        refuse_failed_grammar(finals, "prompt", body.structured_outputs_field())
        choices = []
        for head, final in zip(heads, finals, strict=True):
            for completion in final.outputs:
                logprobs = self._logprobs(
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
            id=request_id, created=now(), model=body.model, choices=choices, usage=usage_of(finals)
        )
        return JSONResponse(response.model_dump())

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
            elif self.base.tokenizer is not None:
                text = self.base.tokenizer.decode(first.prompt_token_ids, skip_special_tokens=False)
            if body.logprobs is not None:
                logprobs = self._echo_logprobs(
                    first.prompt_token_ids, first.prompt_logprobs, body.logprobs
                )
        scored = self.base.prompt_logprobs(first) if body.prompt_logprobs is not None else None
        return PromptHead(position, text, logprobs, scored)

    def _echo_logprobs(
        self, prompt_ids: list[int], scored: list[dict[int, float] | None], k: int
    ) -> CompletionLogprobs:
        """The echoed prompt's tokens as completions logprobs: none for the first token,
        then each token's and its position's k likeliest."""
        logprobs = [None] + [e[t] for e, t in zip(scored[1:], prompt_ids[1:], strict=True)]
        top = None
        if k:  # a position's entry holds its own token first, then the likeliest
            top = [None] + [dict(sorted(e.items(), key=lambda i: -i[1])[:k]) for e in scored[1:]]
        return self._logprobs(prompt_ids, logprobs, top)

    async def _events(
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
        async with aclosing(merged_outputs(streams)) as merged:
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
                    logprobs = self._logprobs(
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
                yield sse_event(chunk.model_dump())
        if options.include_usage:
            last = CompletionResponse(
                id=request_id, created=created, model=model, choices=[], usage=usage.total()
            )
            yield sse_event(last.model_dump())

    def _logprobs(
        self,
        token_ids: Sequence[int],
        logprobs: list[float | None] | None,
        top: list[dict[int, float] | None] | None,
        offset: int = 0,
    ) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        tokens = [self.base.token_text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top_logprobs = None
        if top is not None:
            top_logprobs = [
                None if row is None else {self.base.token_text(t): lp for t, lp in row.items()}
                for row in top
            ]
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=list(logprobs),
            top_logprobs=top_logprobs,
            text_offset=offsets,
        )


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
