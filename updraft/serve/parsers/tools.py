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
  ``{"name": ..., "parameters": {...}}`` separated by ``;``), ``mistral``
  (``[TOOL_CALLS]``), ``deepseek_v3`` (``<｜tool▁calls▁begin｜>``) or ``phi4_mini_json``
  (``functools[...]``); see tool_parsers.py and marked_calls.py. A model may write a
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

PARSERS = ("hermes", "llama3_json", "mistral", "deepseek_v3", "phi4_mini_json")
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


# What in a chat template's text shows which syntax its model writes calls in, looked
# for in this order (a template that names <tool_call> is Hermes-style whatever else it
# says). DeepSeek's markers are matched without their bars, which templates escape in
# more than one way.
TEMPLATE_MARKERS = (
    ("hermes", (HERMES_OPEN,)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("deepseek_v3", ("tool▁calls▁begin", "tool\\u2581calls\\u2581begin")),
    ("phi4_mini_json", ("functools", "<|/tool|>")),
    ("llama3_json", ("<|python_tag|>", '"parameters"')),
)


def default_parser(template_source: str) -> str:
    """The parser a chat template's own tool syntax calls for (``TEMPLATE_MARKERS``);
    hermes for a template that says nothing of tools."""
    for parser, markers in TEMPLATE_MARKERS:
        if any(marker in template_source for marker in markers):
            return parser
    return "hermes"


def required_spec(
    tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool
) -> StructuredOutputsParams:
    """The grammar of a reply that calls a tool: ``choice`` names a function, or is
    ``"required"`` (any of ``tools``, one call unless ``parallel``)."""
    schemas = {tool["function"]["name"]: _parameters(tool) for tool in tools}
    if isinstance(choice, dict):
        return StructuredOutputsParams(json=schemas[choice["function"]["name"]])
    definitions: dict[str, Any] = {}
    alternatives = []
    for name, schema in schemas.items():
        if _refers(schema):
            # Nested under anyOf, a schema's own refs ("#/$defs/City", "#") would no
            # longer resolve from the root: it moves to the root's $defs, refs rewritten.
            definitions.update(_hoisted(name, schema))
            schema = {"$ref": f"#/$defs/{name}"}
        alternatives.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": alternatives}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    if definitions:
        array["$defs"] = definitions
    return StructuredOutputsParams(json=array)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


# Where a JSON schema keeps definitions that refs point at.
DEFINITIONS = ("$defs", "definitions")


def _refers(schema: dict[str, Any]) -> bool:
    try:
        return '"$ref"' in json.dumps(schema)
    except (TypeError, ValueError, RecursionError):
        return False  # the spec's own check names what is wrong with it


def _hoisted(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema as root definitions: the schema itself under the
    tool's name (a function name, so no "." or "/"), each of its root definitions under
    "<name>.<$defs or definitions>.<key>", every local ref rewritten to match."""

    def moved(ref: str) -> str:
        segments = ref[1:].split("/")
        if len(segments) >= 3 and segments[0] == "" and segments[1] in DEFINITIONS:
            key = f"{name}.{segments[1]}.{segments[2]}"  # the key is escaped as it was
            return "/".join(["#", "$defs", key, *segments[3:]])
        return f"#/$defs/{name}{ref[1:]}"

    def rewrite(node: dict[str, Any]) -> dict[str, Any]:
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            node["$ref"] = moved(ref)
        return node

    copy = json.loads(json.dumps(schema), object_hook=rewrite)  # a copy, refs rewritten
    hoisted = {name: {k: v for k, v in copy.items() if k not in DEFINITIONS}}
    for where in DEFINITIONS:
        definitions = copy.get(where)
        for key, definition in (definitions if isinstance(definitions, dict) else {}).items():
            hoisted[f"{name}.{where}.{key}"] = definition
    return hoisted


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
    """What one step of a reply adds: content, tool-call deltas (OpenAI's shape) and
    reasoning."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str = ""

    def __add__(self, later: Delta) -> Delta:
        return Delta(
            self.content + later.content,
            self.tool_calls + later.tool_calls,
            self.reasoning + later.reasoning,
        )


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


def call_from_json(value: Any) -> ToolCall | None:
    """A parsed JSON value as a call: an object with a string name and object
    arguments (``arguments`` or ``parameters``; an object's JSON text is taken too)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return call_of(value["name"], value.get("arguments", value.get("parameters")))


def call_of(name: str, arguments: Any) -> ToolCall | None:
    """A call to ``name`` if ``arguments`` is a JSON object (or its text), else None."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def send_call(delta: Delta, calls: list[ToolCall], call: ToolCall) -> None:
    """A whole call into ``delta`` as OpenAI streams one: its id and name first, then
    its arguments."""
    index = len(calls)
    calls.append(call)
    delta.tool_calls.append(head_delta(index, call))
    delta.tool_calls.append({"index": index, "function": {"arguments": call.arguments}})


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def head_delta(index: int, call: ToolCall) -> dict[str, Any]:
    return {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": ""},
    }
