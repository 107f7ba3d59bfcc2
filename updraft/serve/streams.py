"""How a response goes out: one request's outputs merged over its prompts, the whole
outputs at the end, or server-sent events ending in ``data: [DONE]``; and the usage."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing

from starlette.responses import StreamingResponse
from starlette.types import Send

from updraft.outputs import RequestOutput, merge_outputs
from updraft.serve.engine_client import EngineDeadError, ShuttingDownError
from updraft.serve.errors import APIError, error_body
from updraft.serve.protocol import Usage

Started = tuple[AsyncIterator[RequestOutput], RequestOutput]  # the outputs, the first one


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body when the response ends however it ends, so a client gone
    mid-stream aborts its request at once instead of when the generator is collected."""

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


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


async def sse(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, then ``[DONE]``. The status line has gone out before the first
    event, so an engine failure mid-stream becomes an error event."""
    async with aclosing(events):
        try:
            async for event in events:
                yield event
        except (EngineDeadError, ShuttingDownError) as error:
            yield sse_event(error_body(503, str(error)))
    yield "data: [DONE]\n\n"


async def with_first(
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


async def merged_outputs(streams: list[Started]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every prompt's outputs as they come, with the prompt's position; closing it
    aborts whatever has not finished."""
    if len(streams) == 1:
        outputs, first = streams[0]
        async with aclosing(with_first(first, outputs)) as stream:
            async for output in stream:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(position: int, outputs: AsyncIterator[RequestOutput], first) -> None:
        try:
            async with aclosing(with_first(first, outputs)) as stream:
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


async def final_outputs(streams: list[Started]) -> list[RequestOutput]:
    """Per prompt, its outputs to the end as one (n completions in index order)."""
    latest: list[dict[int, RequestOutput]] = [{} for _ in streams]
    try:
        async with aclosing(merged_outputs(streams)) as merged:
            async for position, output in merged:
                latest[position][output.outputs[0].index] = output
    except (EngineDeadError, ShuttingDownError) as error:
        raise APIError(503, str(error)) from error
    return [merge_outputs(list(outputs.values())) for outputs in latest]


def usage_of(finals: list[RequestOutput]) -> Usage:
    prompt = sum(final.metrics.num_prompt_tokens for final in finals)
    completion = sum(final.metrics.num_output_tokens for final in finals)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
