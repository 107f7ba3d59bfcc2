"""Calls written in a section that a marker opens, as Mistral, DeepSeek and Phi-4-mini
models write them: content streams out until the marker (text that may be its start is
held back), the section is held until it ends, and its calls go out once the whole
section parses; a section that does not parse (arguments that are not a JSON object, a
name that is not one) goes out as content, marker and all. Content may follow a section,
and another section may follow it.

* ``mistral``: ``[TOOL_CALLS]`` then either a JSON array of ``{"name", "arguments"}``
  objects (Mistral 7B v0.3, Nemo) or ``name[ARGS]{...}``, one marker per call (Mistral
  Small 3.2, Devstral; ``[CALL_ID]id`` may sit between the name and ``[ARGS]``).
* ``deepseek_v3``: ``<｜tool▁calls▁begin｜>`` then calls, each
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>name`` and its arguments in a fenced
  JSON block (DeepSeek V3, R1) or ``<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}``
  (V3.1), each closed by ``<｜tool▁call▁end｜>``, up to ``<｜tool▁calls▁end｜>``.
* ``phi4_mini_json``: ``functools`` then a JSON array of ``{"name", "arguments"}``
  objects (Phi-4-mini).
"""

from __future__ import annotations

import json
import re

from updraft.serve.parsers.tools import (
    Delta,
    ToolCall,
    call_from_json,
    call_of,
    held_back,
    json_value_end,
    send_call,
)

# Where a section ends and what it holds: (characters read, its calls or None when it
# is content); None while the section is not whole yet.
Section = tuple[int, list[ToolCall] | None] | None

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, CALL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DEEPSEEK_CALL = re.compile(re.escape(CALL_BEGIN) + "(.*?)" + re.escape(CALL_END), re.DOTALL)
_FENCED_JSON = re.compile(r"\s*```(?:json)?\s*\n(.*)\n?```\s*", re.DOTALL)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class MarkedCallsStream:
    marker = ""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._pending = ""  # text not yet sent or read as a section
        self._in_section = False

    @staticmethod
    def read(text: str, final: bool) -> Section:
        raise NotImplementedError

    def feed(self, text: str) -> Delta:
        delta = Delta()
        self._pending += text
        self._advance(delta, final=False)
        return delta

    def finish(self) -> Delta:
        delta = Delta()
        self._advance(delta, final=True)
        delta.content += self._pending
        self._pending = ""
        return delta

    def _advance(self, delta: Delta, final: bool) -> None:
        while True:
            if not self._in_section:
                at = self._pending.find(self.marker)
                if at < 0:
                    taken = len(self._pending) - (
                        0 if final else held_back(self._pending, self.marker)
                    )
                    delta.content += self._pending[:taken]
                    self._pending = self._pending[taken:]
                    return
                delta.content += self._pending[:at]
                self._pending = self._pending[at + len(self.marker) :]
                self._in_section = True
            section = self.read(self._pending, final)
            if section is None:
                return
            end, calls = section
            if calls is None:
                delta.content += self.marker + self._pending[:end]
            for call in calls or ():
                send_call(delta, self.calls, call)
            self._pending = self._pending[end:]
            self._in_section = False


def _json_array_calls(text: str, start: int, final: bool) -> Section:
    """A JSON array of call objects at ``text[start:]``."""
    end = json_value_end(text, start)
    if end is None:
        return (len(text), None) if final else None
    try:
        values = json.loads(text[start:end])
    except (ValueError, RecursionError):
        return end, None
    if not isinstance(values, list) or not values:
        return end, None
    calls = [call_from_json(value) for value in values]
    return end, None if None in calls else calls  # type: ignore[return-value]


def _first_visible(text: str) -> int:
    return len(text) - len(text.lstrip())


class MistralStream(MarkedCallsStream):
    marker = "[TOOL_CALLS]"

    @staticmethod
    def read(text: str, final: bool) -> Section:
        start = _first_visible(text)
        if start == len(text):
            return (len(text), None) if final else None
        if text[start] == "[":
            return _json_array_calls(text, start, final)
        name = re.match(r"[A-Za-z0-9_.-]*", text).group()
        rest = text[len(name) :]
        if rest and not any(tag.startswith(rest[: len(tag)]) for tag in ("[ARGS]", "[CALL_ID]")):
            return 0, None  # not a name and its arguments
        at = text.find("[ARGS]")
        if at < 0:
            return (len(text), None) if final else None
        begin = at + len("[ARGS]")
        end = json_value_end(text, begin)
        if end is None:
            if not final:
                return None
            end = len(text)
        call = call_of(name, text[begin:end]) if _NAME.fullmatch(name) else None
        return end, None if call is None else [call]


class DeepSeekV3Stream(MarkedCallsStream):
    marker = CALLS_BEGIN

    @staticmethod
    def read(text: str, final: bool) -> Section:
        at = text.find(CALLS_END)
        if at < 0 and not final:
            return None
        body, end = (text, len(text)) if at < 0 else (text[:at], at + len(CALLS_END))
        bodies = _DEEPSEEK_CALL.findall(body)
        if not bodies or _DEEPSEEK_CALL.sub("", body).strip():
            return end, None
        calls = [_deepseek_call(call) for call in bodies]
        return end, None if None in calls else calls  # type: ignore[return-value]


def _deepseek_call(text: str) -> ToolCall | None:
    """One call's text between its begin and end markers: ``function``, the separator,
    the name and a fenced JSON block (V3); or the name, the separator and the JSON
    (V3.1)."""
    head, sep, rest = text.partition(CALL_SEP)
    if not sep:
        return None
    if "```" in rest:
        name, _, block = rest.partition("\n")
        fenced = _FENCED_JSON.fullmatch(block)
        if head.strip() != "function" or fenced is None:
            return None
        name, arguments = name.strip(), fenced.group(1)
    else:
        name, arguments = head.strip(), rest
    return call_of(name, arguments) if _NAME.fullmatch(name) else None


class Phi4MiniJsonStream(MarkedCallsStream):
    marker = "functools"

    @staticmethod
    def read(text: str, final: bool) -> Section:
        start = _first_visible(text)
        if start == len(text):
            return (len(text), None) if final else None
        if text[start] != "[":
            return 0, None
        return _json_array_calls(text, start, final)
