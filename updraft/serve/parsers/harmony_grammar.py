"""Grammars for harmony replies (harmony.py): what a request constrains is the answer, not
the reasoning. The reply may think first, in any number of ``analysis`` messages whose
text is free (a text terminal matches no special token, so only ``<|end|>`` ends one),
then writes the constrained message:

* a ``response_format`` JSON schema or object: the ``final`` message's text is that
  JSON (Lark with llguidance's special-token and ``%json`` syntax);
* a required or named tool call: a ``commentary`` message to ``functions.NAME`` whose
  text is that function's arguments.

Other specs (a regex, a choice, a grammar) start after the final channel's header
(``StructuredOutputsParams.starts_after``), since they cannot be embedded in Lark as
they are.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from updraft.engine.grammar_compiler import JSON_OPTIONS
from updraft.serve.parsers.harmony import CHANNEL, MESSAGE
from updraft.structured_outputs import StructuredOutputsParams

# The reply's reasoning messages; the prompt opened the first message's <|start|>assistant.
THINKING = (
    "start: thought* answer\n"
    'thought: <|channel|> "analysis" <|message|> free <|end|> <|start|> "assistant"\n'
    "free: /(?s:.*)/\n"
)
FINAL_HEADER = CHANNEL + "final" + MESSAGE


def final_answer_spec(spec: StructuredOutputsParams, encode: Any) -> StructuredOutputsParams:
    """``spec`` applied to the final message only; ``encode(text) -> list[int]`` spells
    the final channel's header for specs that start after it (and for a schema whose
    text is not JSON, which the compiler then names)."""
    try:
        if spec.json_object:
            body = _json_text({"type": "object"})
        elif spec.json is not None:
            body = _json_text(json.loads(spec.json) if isinstance(spec.json, str) else spec.json)
        else:
            body = None
    except (ValueError, RecursionError):
        body = None
    if body is None:
        return replace(spec, starts_after=tuple(encode(FINAL_HEADER)))
    answer = 'answer: <|channel|> "final" <|message|> body\n'
    return StructuredOutputsParams(grammar=f"{THINKING}{answer}body: %json {body}\n")


def call_spec(tools: list[dict[str, Any]], named: str | None) -> StructuredOutputsParams:
    """A reply that calls ``named``, or any of ``tools`` (``tool_choice: required``):
    one call, since ``<|call|>`` ends the reply."""
    calls, bodies = [], []
    for index, tool in enumerate(tools):
        name = tool["function"]["name"]
        if named is not None and name != named:
            continue
        header = json.dumps(f"commentary to=functions.{name} ")
        calls.append(f'<|channel|> {header} <|constrain|> "json" <|message|> args{index}')
        parameters = tool["function"].get("parameters") or {"type": "object", "properties": {}}
        bodies.append(f"args{index}: %json {_json_text(parameters)}")
    answer = "answer: " + " | ".join(calls) + "\n" + "\n".join(bodies) + "\n"
    return StructuredOutputsParams(grammar=THINKING + answer)


def _json_text(schema: Any) -> str:
    """A schema for ``%json``, with the compiler's JSON layout (one line, its separators)
    unless it names its own."""
    if isinstance(schema, dict):
        schema = {"x-guidance": JSON_OPTIONS, **schema}
    return json.dumps(schema)
