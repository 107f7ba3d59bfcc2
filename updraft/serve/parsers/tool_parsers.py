"""Calls a model wrote in its own syntax (``tool_choice: "auto"``), read from its reply
as it streams: content goes out as it comes, calls go out once each is whole and parses.
``parse`` reads a whole reply the same way.

* ``hermes``: content with ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks in it (Qwen2.5, Qwen3). Text that may be the start of a tag is held back until
  it is known not to be one; a block that does not parse is content, tags and all; an
  unclosed block at the end is a call if what it holds parses.
* ``llama3_json``: Llama 3.x's JSON form, where a reply that calls tools is nothing but
  the calls, ``{"name": ..., "parameters": {...}}`` objects separated by ``;``. A reply
  that begins with ``{`` is held until its end, then read as calls, or sent as content
  if it is not one.
* ``mistral``, ``deepseek_v3``, ``phi4_mini_json``: calls in a section after a marker
  (marked_calls.py).
"""

from __future__ import annotations

import json
from typing import Protocol

from updraft.serve.parsers.marked_calls import DeepSeekV3Stream, MistralStream, Phi4MiniJsonStream
from updraft.serve.parsers.tools import (
    HERMES_CLOSE,
    HERMES_OPEN,
    Delta,
    ToolCall,
    call_from_json,
    held_back,
    send_call,
)


class ReplyStream(Protocol):
    calls: list[ToolCall]

    def feed(self, text: str) -> Delta: ...

    def finish(self) -> Delta: ...


def parse(stream: ReplyStream, text: str) -> tuple[str, list[ToolCall]]:
    """A whole reply: its content and its calls."""
    first, last = stream.feed(text), stream.finish()
    return first.content + last.content, stream.calls


class HermesStream:
    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._pending = ""  # text not yet sent or taken into a call
        self._call: str | None = None  # the open block's text, or None outside one

    def feed(self, text: str) -> Delta:
        delta = Delta()
        self._pending += text
        while True:
            tag = HERMES_OPEN if self._call is None else HERMES_CLOSE
            at = self._pending.find(tag)
            if at < 0:
                taken = len(self._pending) - held_back(self._pending, tag)
                self._take(delta, self._pending[:taken])
                self._pending = self._pending[taken:]
                return delta
            self._take(delta, self._pending[:at])
            self._pending = self._pending[at + len(tag) :]
            if self._call is None:
                self._call = ""
            else:
                self._close(delta, HERMES_CLOSE)

    def _take(self, delta: Delta, text: str) -> None:
        if self._call is None:
            delta.content += text
        else:
            self._call += text

    def _close(self, delta: Delta, closing: str) -> None:
        text, self._call = self._call, None
        try:
            call = call_from_json(json.loads(text))
        except (ValueError, RecursionError):
            call = None
        if call is None:
            delta.content += HERMES_OPEN + text + closing
        else:
            send_call(delta, self.calls, call)

    def finish(self) -> Delta:
        delta = Delta()
        if self._call is not None:
            self._call += self._pending
            self._pending = ""
            self._close(delta, "")
        delta.content += self._pending
        self._pending = ""
        return delta


class Llama3JsonStream:
    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._text = ""
        self._calls_first: bool | None = None  # unknown until the first visible character

    def feed(self, text: str) -> Delta:
        if self._calls_first is False:
            return Delta(content=text)
        self._text += text
        visible = self._text.lstrip()
        if not visible:
            return Delta()
        self._calls_first = visible.startswith("{")
        if self._calls_first:
            return Delta()
        text, self._text = self._text, ""
        return Delta(content=text)

    def finish(self) -> Delta:
        text, self._text = self._text, ""
        calls = _semicolon_calls(text) if self._calls_first else None
        if calls is None:
            return Delta(content=text)
        delta = Delta()
        for call in calls:
            send_call(delta, self.calls, call)
        return delta


def _semicolon_calls(text: str) -> list[ToolCall] | None:
    decoder, calls, position = json.JSONDecoder(), [], 0
    while True:
        while position < len(text) and text[position].isspace():
            position += 1
        try:
            value, position = decoder.raw_decode(text, position)
        except (ValueError, RecursionError):
            return None
        call = call_from_json(value)
        if call is None:
            return None
        calls.append(call)
        while position < len(text) and text[position].isspace():
            position += 1
        if position == len(text):
            return calls
        if text[position] != ";":
            return None
        position += 1


STREAMS: dict[str, type[ReplyStream]] = {
    "hermes": HermesStream,
    "llama3_json": Llama3JsonStream,
    "mistral": MistralStream,
    "deepseek_v3": DeepSeekV3Stream,
    "phi4_mini_json": Phi4MiniJsonStream,
}


def reply_stream(parser: str) -> ReplyStream:
    return STREAMS[parser]()
