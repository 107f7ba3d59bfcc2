"""Tool calls: the grammar that makes a model call the tools a client requires, and the
calls read back out of what a model wrote, whole or as a stream of deltas.

* ``tool_choice: "required"`` and a named function constrain decoding (structured
  outputs), as vLLM does: the output is JSON of a known shape, a named function's
  arguments object, or for ``required`` an array of ``{"name", "parameters"}`` objects,
  so every output is a call whose arguments validate against its function's schema,
  whatever the model learned. Arguments stream as they are generated.
* ``tool_choice: "auto"`` reads the model's own syntax with a named parser: ``hermes``
  (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Qwen2.5 and Qwen3
  write it) or ``llama3_json`` (Llama 3.x: the whole reply is the calls, JSON objects
  ``{"name": ..., "parameters": {...}}`` separated by ``;``). A model may write a
  malformed call, so each call is checked whole before it is sent; one that does not
  parse is sent as content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from updraft.structured_outputs import StructuredOutputsParams

PARSERS = ("hermes", "llama3_json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
# A call's head in the JSON shapes above: its name, then where its arguments begin.
_CALL_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:parameters|arguments)"\s*:\s*'
)
_PRIMITIVE = re.compile(r"[^,\]}\s]*")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def default_parser(template_source: str) -> str:
    """The parser a chat template's own tool syntax calls for: hermes where it writes
    <tool_call> blocks or says nothing of tools, llama3_json where it speaks of
    Llama 3's python tag or of "parameters"."""
    if HERMES_OPEN in template_source:
        return "hermes"
    if "<|python_tag|>" in template_source or '"parameters"' in template_source:
        return "llama3_json"
    return "hermes"


def required_spec(
    tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool
) -> StructuredOutputsParams:
    """The grammar of a reply that calls a tool: ``choice`` names a function, or is
    ``"required"`` (any of ``tools``, one call unless ``parallel``)."""
    schemas = {tool["function"]["name"]: _parameters(tool) for tool in tools}
    if isinstance(choice, dict):
        return StructuredOutputsParams(json=schemas[choice["function"]["name"]])
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in schemas.items()
        ]
    }
    array: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def json_value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value at ``text[start:]`` (after any whitespace), or
    None when the text ends before the value does."""
    i = start
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    if i == len(text):
        return None
    if text[i] not in '{["':
        end = _PRIMITIVE.match(text, i).end()
        return end if end < len(text) else None
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        c = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return j + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


@dataclass
class Delta:
    """What one step of a reply adds: content, and tool-call deltas (OpenAI's shape)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __add__(self, later: Delta) -> Delta:
        return Delta(self.content + later.content, self.tool_calls + later.tool_calls)


class CallStream:
    """The calls of a constrained reply as it is generated: ``named`` (the reply is that
    function's arguments) or else the ``required`` array. A name goes out as soon as it
    is whole, arguments fragment by fragment as they arrive."""

    def __init__(self, named: str | None = None) -> None:
        self.named = named
        self.text = ""
        self.calls: list[ToolCall] = []
        self._starts: list[int] = []  # where each call's object begins in the text
        self._sent: list[int] = []  # argument characters sent, per call

    def feed(self, text: str) -> Delta:
        self.text += text
        if self.named is not None:
            return self._named(text)
        deltas = []
        # Calls before the last are whole: look again from the last one on.
        position = self._starts[-1] if self._starts else 0
        while (head := _CALL_HEAD.search(self.text, position)) is not None:
            if head.start() in self._starts:
                index = self._starts.index(head.start())
            else:
                index = len(self.calls)
                self.calls.append(ToolCall(json.loads(f'"{head.group(1)}"'), ""))
                self._starts.append(head.start())
                self._sent.append(0)
                deltas.append(head_delta(index, self.calls[index]))
            end = json_value_end(self.text, head.end())
            known = self.text[head.end() : len(self.text) if end is None else end]
            if len(known) > self._sent[index]:
                fragment = known[self._sent[index] :]
                deltas.append({"index": index, "function": {"arguments": fragment}})
                self._sent[index] = len(known)
                self.calls[index].arguments = known.strip()
            if end is None:
                break
            position = end
        return Delta(tool_calls=deltas)

    def _named(self, text: str) -> Delta:
        if not self.calls:
            self.calls.append(ToolCall(self.named, text))
            head = head_delta(0, self.calls[0])
            head["function"]["arguments"] = text
            return Delta(tool_calls=[head])
        self.calls[0].arguments += text
        return Delta(tool_calls=[{"index": 0, "function": {"arguments": text}}] if text else [])

    def finish(self) -> Delta:
        return Delta()


def head_delta(index: int, call: ToolCall) -> dict[str, Any]:
    return {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": ""},
    }
