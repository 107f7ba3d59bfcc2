"""Structured-output specs to llguidance matchers: compiled once per distinct spec, off
the engine's thread, bounded in time and memory.

A compiled spec is kept as a pristine matcher in a small LRU cache; each request gets a
deep copy (cheap: the grammar and its lexer are shared). llguidance drops the GIL while
it builds a grammar, and its parser limits bound the work: the lexer's regex budget, the
Earley items per step and the grammar's size (a hostile schema fails to compile with a
message, it does not hang the compiler).
"""

from __future__ import annotations

import array
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance

from updraft.runner.side_threads import lower_priority
from updraft.structured_outputs import StructuredOutputsParams
from updraft.tokenizer import Tokenizer

# Distinct specs kept compiled; past it the least recently used one is compiled again.
CACHE_SIZE = 256
COMPILE_THREADS = 2
# llguidance's own defaults, written out, but for the initial fuel: what one compile and
# one mask step may cost.
LIMITS = dict(
    max_items_in_row=2000,
    # Regex analysis before the first mask. llguidance's default of 1,000,000 let a
    # first mask of "a{1000}{1000}b" run for a second before failing; at this fuel it
    # fails within about 0.1 s, and large real schemas (thousands of enum strings, a
    # hundred patterned properties) use a fraction of it.
    initial_lexer_fuel=200_000,
    step_lexer_fuel=200_000,  # about 15 ms per mask
    step_max_items=50_000,
    max_lexer_states=250_000,  # 1-2 kB each
    max_grammar_size=500_000,
    verbose_errors=False,  # a message, not the parser's state
)
MAX_ERROR_CHARS = 600
# A mask that takes longer than this ends its request, the first one at compile (the
# fuel limits keep masks far below it; this bounds what they do not). Counted in the
# CPU time of the thread that computes it (llguidance computes in the caller's thread):
# what the grammar costs, not how long its lower-priority thread waited for a core on a
# busy machine (a 0.1 s first mask took 2.1 s of wall time beside a test suite).
MASK_SECONDS_LIMIT = 2.0
# How each kind of spec reaches llguidance (its grammar_from formats).
FORMATS = {
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",  # Lark, or GBNF, which llguidance converts
}
# JSON as json.dumps writes it, on one line: with whitespace free between tokens a small
# model sampled at temperature 1 can emit spaces and newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A spec that cannot be compiled: ``detail`` is the compiler's message, and the
    error's own names the kind of spec too."""

    def __init__(self, kind: str, detail: str) -> None:
        self.detail = _short(detail)
        super().__init__(f"structured_outputs.{kind}: {self.detail}")


class GrammarCompiler:
    """Compiles specs for one tokenizer (a checkpoint's ``tokenizer.json``) whose tokens
    are the first of the model's ``vocab_size`` logits; ``eos_token_ids`` end a
    constrained output where its grammar is complete."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self._tokenizer_json = tokenizer_json
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # the cache and the tokenizer, across threads
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._pool = ThreadPoolExecutor(
            COMPILE_THREADS, thread_name_prefix="updraft-grammar", initializer=lower_priority
        )

    @classmethod
    def for_model(
        cls, model: str, vocab_size: int, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...]
    ) -> GrammarCompiler:
        """The compiler for a checkpoint's tokenizer (``model_vocabulary``)."""
        return cls(*model_vocabulary(model, vocab_size, tokenizer), eos_token_ids)

    def submit(self, spec: StructuredOutputsParams) -> Future[llguidance.LLMatcher]:
        """A fresh matcher for ``spec``, compiled in a worker thread (the future raises
        ``GrammarError`` if it cannot be)."""
        return self._pool.submit(self.matcher, spec)

    def submit_key(self, key: tuple[str, str]) -> Future[llguidance.LLMatcher]:
        """As ``submit``, for a spec's ``key``: what crosses to the grammar process."""
        return self._pool.submit(self.compiled, key)

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for ``spec``, compiled in this thread unless cached."""
        return self.compiled(spec.key)

    def compiled(self, key: tuple[str, str]) -> llguidance.LLMatcher:
        """A fresh matcher for the spec whose ``key`` it is, compiled unless cached."""
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is not None:
                self._cache.move_to_end(key)
                return pristine.deep_copy()
        pristine = self._compile(*key)
        with self._lock:
            self._cache[key] = pristine
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return pristine.deep_copy()

    def cached_keys(self) -> list[tuple[str, str]]:
        """The specs compiled and kept, least recently used first."""
        with self._lock:
            return list(self._cache)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, kind: str, text: str) -> llguidance.LLMatcher:
        try:
            if kind in ("json", "json_object"):
                grammar = llguidance.LLMatcher.grammar_from_json_schema(text, JSON_OPTIONS)
            else:
                grammar = llguidance.grammar_from(FORMATS[kind], text)
        except ValueError as error:  # not JSON, or GBNF that does not convert
            raise GrammarError(kind, str(error)) from None
        matcher = llguidance.LLMatcher(
            self.tokenizer(), grammar, log_level=0, limits=llguidance.LLParserLimits(**LIMITS)
        )
        if matcher.is_error():
            raise GrammarError(kind, matcher.get_error())
        self._first_mask(kind, matcher)
        return matcher

    def _first_mask(self, kind: str, matcher: llguidance.LLMatcher) -> None:
        """Compute the first mask here, in the compiler's thread: the costliest mask of
        a grammar is usually its first (the lexer's analysis), every copy of the matcher
        then starts from it, and a spec no output can match is refused now, not
        answered with an end of sequence its grammar never allowed."""
        start = time.thread_time()
        # Read as 32-bit words in plain Python: an API process compiles specs too, and
        # never loads torch.
        bits = array.array("I", matcher.compute_bitmask())
        seconds = time.thread_time() - start
        for eos in self._eos_token_ids:
            if eos // 32 < len(bits):
                bits[eos // 32] &= ~(1 << (eos % 32))
        if matcher.is_error() or (not any(bits) and not matcher.is_accepting()):
            raise GrammarError(kind, _why_nothing_matches(matcher, self._eos_token_ids))
        if seconds > MASK_SECONDS_LIMIT:
            raise GrammarError(
                kind,
                f"its first mask took {seconds:.2f} s of CPU, over the limit of "
                f"{MASK_SECONDS_LIMIT:g} s per mask",
            )

    def tokenizer(self) -> llguidance.LLTokenizer:
        """The tokenizer, read on first use (a large vocabulary takes a moment)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    str(self._tokenizer_json),
                    n_vocab=self.vocab_size,
                    eos_token=self._eos_token_ids or None,
                )
            return self._tokenizer


def model_vocabulary(model: str, vocab_size: int, tokenizer: Tokenizer) -> tuple[Path, int]:
    """A checkpoint's ``tokenizer.json``, and the larger of the model's and the
    tokenizer's vocabularies (either may pad the other): what a grammar is compiled for."""
    return Path(model) / "tokenizer.json", max(vocab_size, tokenizer.vocab_size)


def _why_nothing_matches(matcher: llguidance.LLMatcher, eos_token_ids: list[int]) -> str:
    """llguidance's reason when it has one (a lexer past its limits shows it once an
    end of sequence is fed to a copy), else that no output matches."""
    reason = matcher.get_error()
    if not reason and eos_token_ids:
        probe = matcher.deep_copy()
        probe.consume_token(eos_token_ids[0])
        reason = probe.get_error()
    reason = plain_error(reason)
    if not reason or reason.startswith("NoExtension"):  # its own name for "nothing fits"
        return "no output can match it (its grammar allows no first token)"
    return reason


def plain_error(message: str) -> str:
    """llguidance's message without the marker it leaves where verbose errors would
    show the parser's state."""
    return message.replace("<non-verbose/>", "").strip()


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ..."
