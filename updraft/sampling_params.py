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
    logprobs: bool = False
    # The output must match a schema, a regex, a choice or a grammar (None: free text).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        rules = {
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
            "logprobs": (isinstance(self.logprobs, bool), "a bool"),
            "structured_outputs": (
                self.structured_outputs is None
                or isinstance(self.structured_outputs, StructuredOutputsParams),
                "a StructuredOutputsParams or None",
            ),
        }
        for name, (ok, expected) in rules.items():
            if not ok:
                value = _short.repr(getattr(self, name))
                raise ValueError(f"SamplingParams.{name} must be {expected}, got {value}")
        self.stop_token_set = frozenset(self.stop_token_ids)  # checked at every token

    @property
    def greedy(self) -> bool:
        """Temperatures below ``GREEDY_BELOW`` are greedy: dividing logits by one would
        overflow to inf and NaN, and their limit is the argmax anyway."""
        return self.temperature < GREEDY_BELOW


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value
