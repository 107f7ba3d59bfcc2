"""What every endpoint's handler shares (serve/completions, serve/chat): the model
check, the compile of a structured-output spec, intake, and admission.

Intake (engine/input_processor.py) runs here, in the API process, as LLM runs it in its
own: text is tokenized in worker threads, and the engine core receives finished
requests. Each request's first output is awaited before anything is sent, so a prompt
the engine refuses becomes a 400 even when streaming.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TypeVar

from updraft.chat_template import ChatTemplate
from updraft.engine.grammar_compiler import GrammarCompiler, GrammarError
from updraft.engine.input_processor import EngineRequest, InputProcessor
from updraft.engine.intake_checks import params_error
from updraft.outputs import RequestOutput
from updraft.sampling_params import SamplingParams
from updraft.serve.engine_client import EngineClient, EngineDeadError, ShuttingDownError
from updraft.serve.engine_core import EngineInfo
from updraft.serve.errors import APIError
from updraft.serve.protocol import PromptLogprob, PromptLogprobs
from updraft.serve.settings import ServeSettings
from updraft.serve.streams import Started
from updraft.structured_outputs import STRUCTURED_ERROR
from updraft.tokenizer import Tokenizer

# Threads that tokenize prompts and render chat templates: half the cores, so that the
# engine keeps the rest however many clients send huge prompts.
PREPARE_THREADS = max(1, (os.cpu_count() or 2) // 2)
T = TypeVar("T")


class ServingBase:
    """The pieces every endpoint's handler shares, one per API process: its intake, its
    prepare threads and its grammar compiler."""

    def __init__(
        self,
        engine: EngineClient,
        info: EngineInfo,
        settings: ServeSettings,
        chat_template: ChatTemplate,
    ) -> None:
        """``chat_template``: the checkpoint's, read once at start-up."""
        self.engine = engine
        self.info = info
        self.settings = settings
        # Intake (engine/input_processor.py), the same as LLM's, run here: the engine core
        # receives finished requests and never tokenizes.
        self.processor = InputProcessor(engine.tokenizer, info, chat_template)
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

    async def off_loop(self, function: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._workers, function, *args)

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)
        if self._compiler is not None:
            self._compiler.close()

    def check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise APIError(
                404,
                f"model: {model!r} does not exist; this server serves {self.settings.model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def compile(self, params: SamplingParams, field: str | None) -> None:
        """Compile the request's structured-output spec before the request is added, in
        the compiler's own threads (never on the event loop or the engine's thread), so
        that one that cannot compile is a 400 naming ``field``."""
        spec = params.structured_outputs
        if spec is None:
            return
        # A schema's integers are checked first: past 64 bits, the compiler would clamp
        # them and refuse the bound it made, not the one the client wrote.
        refused = params_error(params, self.info.vocab_size)
        if refused is not None:
            raise _intake_refusal(refused.message, refused.field, "", field)
        compiler = self._compiler
        if compiler is None:
            raise APIError(
                400, f"{field}: structured outputs need the model's tokenizer", param=field
            )
        try:
            await asyncio.wrap_future(compiler.submit(spec))
        except GrammarError as error:
            raise APIError(400, f"{field}: {error.detail}", param=field) from error

    async def intake(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        field: str,
        add_special_tokens: bool = True,
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
        return await self.off_loop(self.processor.process, prompt, params, add_special_tokens)

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
            raise _intake_refusal(intake.error, intake.error_field, field, structured_field)
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

    async def start_all(
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

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer else str(token_id)

    def prompt_logprobs(self, output: RequestOutput) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs field: per position, each token's logprob and text."""
        if output.prompt_logprobs is None:
            return None
        return [
            None
            if entry is None
            else {
                str(token): PromptLogprob(logprob=value, decoded_token=self.token_text(token))
                for token, value in entry.items()
            }
            for entry in output.prompt_logprobs
        ]


def _intake_refusal(
    error: str, param: str | None, field: str, structured_field: str | None
) -> APIError:
    """The 400 for a request intake refused, naming the request field at fault: the
    prompt's (``field``) when ``param`` is None, else the one the params' field ``param``
    came from."""
    if param == "structured_outputs" and structured_field is not None:
        message = error.removeprefix(param)
        message = message if message.startswith(":") else f": {message}"
        return APIError(400, f"{structured_field}{message}", param=structured_field)
    if param is None or param == "structured_outputs":
        return _refusal(error, field, None)
    return _refusal(error, param, None)


def refuse_failed_grammar(
    finals: list[RequestOutput], field: str, structured_field: str | None
) -> None:
    """A whole (unstreamed) response in which a choice's constraint failed partway (its
    grammar broke on a token it had allowed, at one of llguidance's limits, or its mask
    failed): the 400 naming the field that a failure at the first token gets, not a 200
    whose choice ends in "error" without saying why. The engine learns of a broken
    grammar from its grammar process a step after the token, so which of the two a
    failure at the first token got would otherwise depend on timing."""
    for final in finals:
        if final.error is not None and final.error.startswith(STRUCTURED_ERROR):
            raise _refusal(final.error, field, structured_field)


def _refusal(error: str, field: str, structured_field: str | None) -> APIError:
    """The 400 for a request the engine or intake refused, naming the field at fault."""
    if structured_field is not None and error.startswith(STRUCTURED_ERROR):
        field, error = structured_field, error.removeprefix(STRUCTURED_ERROR)
    message = error if error.startswith(field) else f"{field}: {error}"
    return APIError(400, message, param=field)
