"""What a request's output must match: a JSON schema, any JSON object, a regular
expression, one of several strings, or a grammar (Lark, or GBNF as llama.cpp writes it).

Named as vLLM names it (``SamplingParams(structured_outputs=StructuredOutputsParams(
json=...))``). This module only says what was asked for and bounds its size; the
engine's grammar compiler (``engine/grammar_compiler.py``) turns it into a matcher.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# A schema or grammar is compiled once per distinct text and held in a cache: bound
# what one request may ask the compiler to read.
MAX_SPEC_CHARS = 1 << 18
MAX_CHOICES = 4096
# What the error of a request whose grammar broke while it ran begins with (the server
# names the request field its spec came from instead).
STRUCTURED_ERROR = "structured_outputs: "


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON schema, as a dict or its text), ``json_object``
    (any JSON object), ``regex``, ``choice`` (the output is one of these strings) or
    ``grammar`` (Lark, or GBNF, told apart by its ``::=`` rules).

    ``starts_after``: token ids the output must contain before the grammar applies (a
    reasoning model's end of reasoning): the output is free up to and including their
    first appearance, and the grammar constrains what follows."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    starts_after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name)]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must name exactly one of json, json_object, regex, choice "
                f"and grammar, got {', '.join(given) or 'none'}"
            )
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not all(
                isinstance(c, str) and c for c in self.choice
            ):
                raise ValueError("structured_outputs.choice must be a list of non-empty strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(
                    f"structured_outputs.choice has {len(self.choice)} strings; at most "
                    f"{MAX_CHOICES} are allowed"
                )
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string")
        if not isinstance(self.starts_after, list | tuple) or not all(
            isinstance(token, int) and token >= 0 for token in self.starts_after
        ):
            raise ValueError("structured_outputs.starts_after must be a list of token ids")
        object.__setattr__(self, "starts_after", tuple(self.starts_after))
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError(
                "structured_outputs.json must be a JSON schema (an object or its text)"
            )
        kind, text = self.key
        if len(text) > MAX_SPEC_CHARS:
            raise ValueError(
                f"structured_outputs.{kind} is {len(text)} characters long; at most "
                f"{MAX_SPEC_CHARS} are allowed"
            )

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the compiler reads, and the key of its cache."""
        if self.json_object:
            return "json_object", '{"type": "object"}'
        if self.json is not None:
            if isinstance(self.json, str):
                return "json", self.json
            try:
                return "json", json.dumps(self.json)
            except (TypeError, ValueError, RecursionError) as error:
                raise ValueError(f"structured_outputs.json is not JSON: {error}") from None
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return "grammar", self.grammar
