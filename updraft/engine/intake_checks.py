"""The checks intake makes of the ids and integers a request carries, before anything is
built from them.

A token id must be an integer in the vocabulary: a negative one overflows the
tokenizer's decoder, and any id past the vocabulary would index past the model's rows.
Every other integer must fit in 64 bits: the engine core receives a served request in
msgpack, which carries integers in [-2**63, 2**64) and no others, and the grammar
compiler and torch read integers as 64-bit values too. Each check names the field, and
the first bad value with where it sits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import numbers
import re
from collections.abc import Iterable, Iterator

from updraft.sampling_params import SamplingParams
from updraft.structured_outputs import StructuredOutputsParams

INT_MIN = -(2**63)  # int64's least
INT_END = 2**64  # one past uint64's greatest
# Every integer past 64 bits has at least this many digits (2**63 has 19).
LONG_DIGITS = re.compile(r"[0-9]{19}")
# An integer this many digits long is quoted by its size instead of in full.
QUOTED_DIGITS = 24


@dataclasses.dataclass(frozen=True)
class IntakeError:
    """Why a request cannot be served, and the field at fault (a SamplingParams field;
    None: the prompt)."""

    message: str
    field: str | None = None


def as_token_ids(values: Iterable[object]) -> list[int]:
    """Ids as plain ints (numpy's integers included); anything else stays as it is, for
    ``token_id_error`` to name."""
    return [
        int(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool) else v for v in values
    ]


def token_id_error(name: str, ids: Iterable[object], vocab_size: int) -> str | None:
    """The first id of ``name`` that is not an integer in [0, vocab_size), described
    with its position (a list) or as a key (a dict's keys)."""
    keys = isinstance(ids, dict)
    ids = ids if keys or isinstance(ids, list | tuple) else list(ids)
    if all(type(token) is int for token in ids) and (
        not ids or (min(ids) >= 0 and max(ids) < vocab_size)
    ):
        return None  # the common case, at C speed: a vocabulary's worth of ids is allowed
    for position, token in enumerate(ids):
        where = "" if keys else f" at position {position}"
        if not isinstance(token, int) or isinstance(token, bool):
            return f"{name}: {_quote(token)}{where} is not a token id (an integer)"
        if not 0 <= token < vocab_size:
            what = "key" if keys else "token id"
            return (
                f"{name}: {what} {_quote(token)}{where} is outside the vocabulary [0, {vocab_size})"
            )
    return None


def params_error(params: SamplingParams, vocab_size: int) -> IntakeError | None:
    """The first token id of the params outside the vocabulary, else the first integer
    anywhere in them (a schema's constants included) that does not fit in 64 bits."""
    token_fields = {
        "logit_bias": params.logit_bias or {},
        "allowed_token_ids": params.allowed_token_ids or (),
        "stop_token_ids": params.stop_token_ids,
    }
    for name, ids in token_fields.items():
        message = token_id_error(name, ids, vocab_size)
        if message is not None:
            return IntakeError(message, name)
    for name, value in vars(params).items():
        if name in token_fields or name == "stop_token_set":
            continue  # ids in the vocabulary: they fit
        of = ""
        if name == "structured_outputs" and value is not None:
            value, of = _schema(value), " of its schema"
        found = next(_oversized(value), None)
        if found is not None:
            pointer, number = found
            where = f" at {pointer or '/'}{of}" if of or pointer else ""
            message = (
                f"{name}: the integer {_quote(number)}{where} does not fit in 64 bits "
                f"(integers must lie in [-2**63, 2**64))"
            )
            return IntakeError(message, name)
    return None


def _schema(spec: StructuredOutputsParams) -> object:
    """A structured-output spec's JSON schema (parsed, if given as text), the one part
    of a spec that holds integers a client wrote; None when its text has no run of
    digits long enough to be past 64 bits (a schema of 256 KiB is walked only then)."""
    schema = spec.json
    try:
        text = schema if isinstance(schema, str) else json.dumps(schema)
    except (TypeError, ValueError, RecursionError):
        return None  # not JSON: the spec's own check names why
    if LONG_DIGITS.search(text) is None:
        return None
    if isinstance(schema, str):
        # Text that is not JSON is left to the grammar compiler, which says why.
        with contextlib.suppress(ValueError, RecursionError):
            return json.loads(schema)
    return schema


def _oversized(value: object) -> Iterator[tuple[str, int]]:
    """(JSON pointer, integer) for each integer in ``value`` outside [INT_MIN, INT_END),
    dict keys included. Iterative: a deeply nested schema cannot exhaust the stack."""
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        pointer, item = stack.pop()
        if isinstance(item, bool):
            continue
        if isinstance(item, int):
            if not INT_MIN <= item < INT_END:
                yield pointer, item
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                stack.append((f"{pointer}/{_escape(key)}", child))
                stack.append((pointer, key))  # an integer key (logit_bias) is checked too
        elif isinstance(item, list | tuple):
            stack.extend((f"{pointer}/{i}", child) for i, child in reversed(list(enumerate(item))))


def _escape(key: object) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _quote(value: object) -> str:
    """A bad value as a message quotes it: a huge integer by its size (its digits may be
    more than Python will print)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if abs(value) < 10**QUOTED_DIGITS:
            return str(value)
        return f"{'-' if value < 0 else ''}2**{abs(value).bit_length() - 1} (or beyond)"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
