"""Request intake: from what a caller sends to the request the engine queues.

An ``InputProcessor`` checks a prompt, tokenizes it, truncates it, checks the token ids
a request's sampling params name, spells its bad words and renders chat templates; what
comes out is an ``EngineRequest``, which the engine only queues. The offline ``LLM`` and
``Engine.add_request`` run it in the engine's process; the server's API processes run
it themselves, off the engine's thread, so the engine core receives finished requests.

Prompt token ids, the token ids the params name and every integer bound for the engine
are checked before anything is built from them (``intake_checks``): a detokenizer over
an id outside the vocabulary can fail (a negative id overflows the tokenizer's decoder),
and an integer past 64 bits cannot reach the engine process.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from updraft.engine.intake_checks import as_token_ids, params_error, token_id_error
from updraft.request import Request
from updraft.sampling_params import SamplingParams
from updraft.tokenizer import Detokenizer, Tokenizer

if TYPE_CHECKING:  # jinja2 costs about 0.1 s to import: only a chat request loads it
    from updraft.chat_template import ChatTemplate

# Bad words whose token spellings are kept (a word is at most 256 characters).
BAD_WORDS_CACHE = 4096


@dataclass(frozen=True)
class ModelLimits:
    """What intake checks a request against; an API process gets it from the engine."""

    model: str  # the checkpoint directory: its tokenizer and chat template
    max_model_len: int  # the longest sequence the engine holds (context or KV cache)
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    context_len: int  # the model's context length, at least max_model_len


@dataclass(frozen=True)
class EngineRequest:
    """A request that has been through intake. ``error``: why it cannot be served (the
    engine then finishes it at once with this message), and ``error_field`` the
    SamplingParams field it is about (None: the prompt); else every id is in the
    vocabulary, every integer fits in 64 bits and the prompt fits."""

    prompt: str | None  # the caller's text, when it sent text
    prompt_token_ids: list[int]  # checked, truncated
    params: SamplingParams
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    error: str | None = None
    error_field: str | None = None

    def build(
        self,
        request_id: str,
        params: SamplingParams,
        tokenizer: Tokenizer | None,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
    ) -> Request:
        """One sequence's ``Request`` with its detokenizer (none without ``tokenizer``):
        the engine's, or an API process's record of it."""
        detokenizer = Detokenizer(
            tokenizer,
            self.prompt_token_ids,
            params.stop,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
        )
        return Request(
            request_id,
            self.prompt,
            self.prompt_token_ids,
            params,
            eos_token_ids,
            time.perf_counter() if arrival_time is None else arrival_time,
            detokenizer,
            self.bad_words_token_ids,
        )


def _spellings(tokenizer: Tokenizer, vocab_size: int, word: str) -> tuple[tuple[int, ...], ...]:
    spellings = []
    for spelling in (word.lstrip(), " " + word.lstrip()):
        ids = tuple(tokenizer.encode(spelling))
        if ids and max(ids) < vocab_size:
            spellings.append(ids)
    return tuple(spellings)


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        limits: ModelLimits,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        """``chat_template``: read from the checkpoint when first needed, if not given."""
        self.tokenizer = tokenizer
        self.limits = limits
        self._chat_template = chat_template
        # Over the tokenizer, not this object: a cache holding it would keep it alive.
        speller = functools.partial(_spellings, tokenizer, limits.vocab_size)
        self._spell = functools.lru_cache(maxsize=BAD_WORDS_CACHE)(speller)

    @property
    def chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            from updraft.chat_template import ChatTemplate

            self._chat_template = ChatTemplate.from_dir(self.limits.model)
        return self._chat_template

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The conversation as the prompt text the model reads (``ChatTemplate.render``;
        a template that fails raises ``ChatTemplateError``)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message needs add_generation_prompt=False: the reply "
                "either continues the last message or starts a new one"
            )
        return self.chat_template.render(
            messages, add_generation_prompt, template_kwargs, tools, continue_final_message
        )

    @property
    def chat_adds_special_tokens(self) -> bool:
        """Whether a rendered chat is encoded with the tokenizer's BOS (only when the
        template does not write its own)."""
        return not self.chat_template.spells_special_tokens

    def process(
        self, prompt: str | Sequence[int], params: SamplingParams, add_special_tokens: bool = True
    ) -> EngineRequest:
        """The request ready for the engine, or one that carries why it cannot be
        served. Ids are checked before anything is built from them; a text is encoded
        with the tokenizer's special tokens unless ``add_special_tokens`` is False."""
        text = prompt if isinstance(prompt, str) else None
        if text is None and len(prompt) >= self.limits.max_model_len:
            # Refused at the cost of len(), before a look at each of a huge list's ids.
            token_ids, error = [], self._check_length(len(prompt))
        else:
            token_ids, error = self._prompt_token_ids(prompt, add_special_tokens)
            if params.truncate_prompt_tokens is not None:
                token_ids = token_ids[-params.truncate_prompt_tokens :]
            error = error or self._check_length(len(token_ids))
        if error is not None:
            return EngineRequest(text, token_ids, params, error=error)
        refused = params_error(params, self.limits.vocab_size)
        if refused is not None:
            return EngineRequest(
                text, token_ids, params, error=refused.message, error_field=refused.field
            )
        bad_words: tuple[tuple[int, ...], ...] = ()
        if params.bad_words:
            if self.tokenizer is None:
                error = f"bad_words: {self.limits.model} has no tokenizer.json to spell them"
                return EngineRequest(text, token_ids, params, error=error, error_field="bad_words")
            bad_words = self._bad_words_token_ids(params.bad_words)
        if params.structured_outputs is not None and self.tokenizer is None:
            error = (
                f"structured outputs need a tokenizer; {self.limits.model} has no tokenizer.json"
            )
            return EngineRequest(
                text, token_ids, params, error=error, error_field="structured_outputs"
            )
        return EngineRequest(text, token_ids, params, bad_words)

    def _prompt_token_ids(
        self, prompt: str | Sequence[int], add_special_tokens: bool
    ) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return [], f"{self.limits.model} has no tokenizer.json; pass token ids"
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as error:
                return [], f"prompt has a lone surrogate at character {error.start}: not text"
            token_ids = self.tokenizer.encode(prompt, add_special_tokens)
        else:
            token_ids = as_token_ids(prompt)
            error = token_id_error("prompt", token_ids, self.limits.vocab_size)
            if error is not None:
                return [], error
        if not token_ids:
            return [], "prompt is empty"
        return token_ids, None

    def _bad_words_token_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word as the model would write it, alone and after a space (as vLLM
        does: a word inside a sentence tokenizes with its leading space). Spellings are
        cached (``BAD_WORDS_CACHE``): a word sent again costs a lookup."""
        sequences: list[tuple[int, ...]] = []
        for word in words:
            for ids in self._spell(word):
                if ids not in sequences:
                    sequences.append(ids)
        return tuple(sequences)

    def _check_length(self, num_prompt_tokens: int) -> str | None:
        limits = self.limits
        if num_prompt_tokens < limits.max_model_len:
            return None
        limit = (
            f"the model's context length {limits.context_len}"
            if limits.max_model_len == limits.context_len
            else f"the KV cache's capacity of {limits.max_model_len} tokens"
        )
        return f"prompt of {num_prompt_tokens} tokens leaves no room to generate within {limit}"
