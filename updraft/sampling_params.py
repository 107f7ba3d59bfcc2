"""Per-request sampling parameters, validated where they are made."""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field

from updraft.structured_outputs import StructuredOutputsParams

GREEDY_BELOW = 1e-5
# Stop conditions are checked at every token of a request: bound what one request may
# ask for, so that it cannot slow down the others.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_LENGTH = 256
MAX_STOP_TOKEN_IDS = 256
# Each of these is looked at for every token a request samples, so they are bounded too.
MAX_LOGIT_BIAS = 1024
MAX_BAD_WORDS = 128
MAX_BAD_WORD_LENGTH = 256
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI and vLLM allow
MAX_N = 128  # OpenAI's bound on choices per request
_short = reprlib.Repr()  # error messages quote at most a short piece of a bad value
_short.maxstring = _short.maxother = 60
_short.maxlist = 4


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop.

    ``temperature == 0`` (or below ``GREEDY_BELOW``) means greedy. ``top_k <= 0``,
    ``top_p == 1`` and ``min_p == 0`` switch their filter off. With a ``seed`` a request
    draws from its own generator, so the same seed gives the same text whatever else
    shares the batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # True or an int k: each output token's logprob (k: with the k likeliest tokens).
    logprobs: bool | int = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    bad_words: list[str] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    # Each prompt token's logprob given the tokens before it (with the k likeliest); the
    # prompt is then computed whole, not taken from the prefix cache.
    prompt_logprobs: int | None = None
    n: int = 1  # sequences drawn from the prompt, sharing its KV blocks
    # The output must match a schema, a regex, a choice or a grammar (None: free text).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        # Each field: (whether its value is valid, what it must be).
        rules = {
            **self._drawing_rules(),
            **self._stopping_rules(),
            **self._logits_rules(),
            **self._output_rules(),
        }
        for name, (ok, expected) in rules.items():
            if not ok:
                value = _short.repr(getattr(self, name))
                raise ValueError(f"SamplingParams.{name} must be {expected}, got {value}")
        self.stop_token_set = frozenset(self.stop_token_ids)  # checked at every token

    def _drawing_rules(self) -> dict[str, tuple[bool, str]]:
        """How the next token is drawn."""
        return {
            "max_tokens": (_is_int(self.max_tokens) and self.max_tokens >= 1, "an int >= 1"),
            "temperature": (_is_number(self.temperature) and self.temperature >= 0, ">= 0"),
            "top_k": (
                _is_int(self.top_k) and -1 <= self.top_k < 2**63,
                "an int >= -1 (0 or -1: off) that fits in 64 bits",
            ),
            "top_p": (_is_number(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            "min_p": (_is_number(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]"),
            "seed": (
                # torch.Generator.manual_seed takes any 64-bit value, signed or not.
                self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64),
                "an int in [-2**63, 2**64) or None",
            ),
        }

    def _stopping_rules(self) -> dict[str, tuple[bool, str]]:
        """When the request stops, and the logprobs it returns."""
        return {
            "stop": (
                len(self.stop) <= MAX_STOP_STRINGS
                and all(
                    isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LENGTH for s in self.stop
                ),
                f"at most {MAX_STOP_STRINGS} non-empty strings of at most "
                f"{MAX_STOP_STRING_LENGTH} characters",
            ),
            "stop_token_ids": (
                len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
                and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                f"at most {MAX_STOP_TOKEN_IDS} ints >= 0",
            ),
            "ignore_eos": (isinstance(self.ignore_eos, bool), "a bool"),
            "logprobs": (
                self.logprobs is None
                or isinstance(self.logprobs, bool)
                or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
                f"a bool or an int in [0, {MAX_TOP_LOGPROBS}]",
            ),
        }

    def _logits_rules(self) -> dict[str, tuple[bool, str]]:
        """What changes the logits it samples from."""
        return {
            "presence_penalty": (
                _is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
                "in [-2, 2]",
            ),
            "frequency_penalty": (
                _is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
                "in [-2, 2]",
            ),
            "repetition_penalty": (
                _is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 100,
                "in (0, 100]",
            ),
            "logit_bias": (
                self.logit_bias is None
                or (
                    isinstance(self.logit_bias, dict)
                    and len(self.logit_bias) <= MAX_LOGIT_BIAS
                    and all(_is_int(t) and t >= 0 for t in self.logit_bias)
                    and all(_is_number(b) and -100 <= b <= 100 for b in self.logit_bias.values())
                ),
                f"a dict of at most {MAX_LOGIT_BIAS} token ids >= 0 to biases in [-100, 100]",
            ),
            "min_tokens": (
                _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
                f"an int in [0, max_tokens={self.max_tokens}]",
            ),
            "bad_words": (
                len(self.bad_words) <= MAX_BAD_WORDS
                and all(
                    isinstance(w, str) and len(w.strip()) > 0 and len(w) <= MAX_BAD_WORD_LENGTH
                    for w in self.bad_words
                ),
                f"at most {MAX_BAD_WORDS} non-blank strings of at most {MAX_BAD_WORD_LENGTH} "
                "characters",
            ),
            "allowed_token_ids": (
                self.allowed_token_ids is None
                or (
                    len(self.allowed_token_ids) > 0
                    and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)
                ),
                "a non-empty list of ints >= 0, or None",
            ),
        }

    def _output_rules(self) -> dict[str, tuple[bool, str]]:
        """What the output holds, and how the prompt is taken."""
        return {
            "include_stop_str_in_output": (
                isinstance(self.include_stop_str_in_output, bool),
                "a bool",
            ),
            "skip_special_tokens": (isinstance(self.skip_special_tokens, bool), "a bool"),
            "truncate_prompt_tokens": (
                self.truncate_prompt_tokens is None
                or (_is_int(self.truncate_prompt_tokens) and self.truncate_prompt_tokens >= 1),
                "an int >= 1 or None",
            ),
            "prompt_logprobs": (
                self.prompt_logprobs is None
                or (
                    _is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
                ),
                f"an int in [0, {MAX_TOP_LOGPROBS}] or None",
            ),
            "n": (_is_int(self.n) and 1 <= self.n <= MAX_N, f"an int in [1, {MAX_N}]"),
            "structured_outputs": (
                self.structured_outputs is None
                or isinstance(self.structured_outputs, StructuredOutputsParams),
                "a StructuredOutputsParams or None",
            ),
        }

    @property
    def greedy(self) -> bool:
        """Temperatures below ``GREEDY_BELOW`` are greedy: dividing logits by one would
        overflow to inf and NaN, and their limit is the argmax anyway."""
        return self.temperature < GREEDY_BELOW

    @property
    def returns_logprobs(self) -> bool:
        return self.logprobs is not None and self.logprobs is not False

    @property
    def num_top_logprobs(self) -> int:
        """The alternatives asked for at each token (0: the sampled token's alone)."""
        return 0 if isinstance(self.logprobs, bool) or self.logprobs is None else self.logprobs

    @property
    def adjusts_logits(self) -> bool:
        """Whether any field changes the logits the request samples from."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
            or self.bad_words
            or self.allowed_token_ids is not None
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value
