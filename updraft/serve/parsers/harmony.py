"""OpenAI's harmony format (gpt-oss): a reply is a run of messages, each a header, then
``<|message|>``, then its text, closed by ``<|end|>``, ``<|call|>`` or ``<|return|>``;
each message after the first opens with ``<|start|>assistant`` (the prompt opens the
first). The header names the channel and, for a tool call, the recipient, before or
after the channel::

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json
    <|message|>{"zone": "CET"}<|call|>

``analysis`` text is ``reasoning_content``; ``final`` text (and a ``commentary`` message
to no one, a preamble) is ``content``; a message to ``functions.NAME`` is a tool call,
sent once its message is whole and its arguments are a JSON object. A call to a tool
the request did not offer, a call cut short, a header that names no known channel or
that runs on without ``<|message|>``, and text where a header or ``<|start|>`` belongs
all come back as content, as written, markers and all. ``<|call|>`` and ``<|return|>``
end generation and add no text: a call whose message ends the reply ended on its own
unless the reply was cut (``finish(cut=True)``).

The reader reads text with special tokens kept (``skip_special_tokens`` false), whole
or in pieces of any size, and gives the same deltas either way. Harmony is chosen from
the chat template's text (``is_harmony``).
"""

from __future__ import annotations

import enum
from collections.abc import Collection

from updraft.serve.parsers.tools import Delta, ToolCall, call_of, held_back, send_call

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
CLOSERS = (END, CALL, RETURN)
CHANNELS = ("analysis", "commentary", "final")
ROLE = "assistant"
FUNCTIONS = "functions."
# A header longer than this is not one: its text goes out as content.
MAX_HEADER_CHARS = 256


def is_harmony(template_source: str) -> bool:
    """Whether a chat template writes harmony's channels (gpt-oss's does)."""
    return CHANNEL in template_source and "<|message|>" in template_source


class Where(enum.Enum):
    HEADER = "header"  # before a message's <|message|>
    BODY = "body"  # in a message's text
    BETWEEN = "between"  # after a message, before <|start|>
    RAW = "raw"  # not harmony: everything left is content


class HarmonyReader:
    """One reply's reasoning, content and calls, as a ``ReplyReader`` reads them;
    ``tool_names``: the functions the request offered (a call to another is content)."""

    def __init__(self, tool_names: Collection[str] = ()) -> None:
        self.tool_names = frozenset(tool_names)
        self.calls: list[ToolCall] = []
        self._where = Where.HEADER
        self._needs_role = False  # the prompt wrote the first message's <|start|>assistant
        self._pending = ""  # text not yet read
        self._message = ""  # the current message's text read so far, as written
        self._sink: str | None = None  # where its text goes: reasoning, content or None (call)
        self._recipient = ""
        self._body_at = 0  # where a call's arguments begin in ``_message``

    def feed(self, text: str) -> Delta:
        delta = Delta()
        self._pending += text
        self._advance(delta)
        return delta

    def finish(self, cut: bool = False) -> Delta:
        """What is left once the reply has ended (``cut``: by its length limit)."""
        delta = Delta()
        pending, self._pending = self._pending, ""
        if self._where is Where.BODY and self._sink is not None:
            self._emit(delta, self._sink, pending)
        elif self._where is Where.BODY and not cut:
            self._message += pending
            self._close_call(delta, self._message[self._body_at :])
        else:
            delta.content += self._message + pending
        self._message = ""
        self._where = Where.RAW
        return delta

    def read_all(self, text: str, cut: bool = False) -> Delta:
        """A whole reply, as one delta."""
        return self.feed(text) + self.finish(cut)

    def _advance(self, delta: Delta) -> None:
        while self._pending:
            if self._where is Where.RAW:
                delta.content += self._pending
                self._pending = ""
            elif self._where is Where.HEADER:
                if not self._read_header(delta):
                    return
            elif self._where is Where.BODY:
                if not self._read_body(delta):
                    return
            elif not self._read_between():
                return

    def _read_between(self) -> bool:
        """After a message: ``<|start|>`` opens the next; anything else is content."""
        if len(self._pending) < len(START) and START.startswith(self._pending):
            return False
        if self._pending.startswith(START):
            self._pending = self._pending[len(START) :]
            self._message, self._needs_role, self._where = START, True, Where.HEADER
        else:
            self._where = Where.RAW
        return True

    def _read_header(self, delta: Delta) -> bool:
        at = self._pending.find(MESSAGE)
        head = self._pending if at < 0 else self._pending[:at]
        if not _may_be_header(head, self._needs_role, whole=at >= 0):
            self._raw(delta)
            return True
        if at < 0:
            return False
        header = _parsed_header(head.removeprefix(ROLE) if self._needs_role else head)
        if header is None:
            self._raw(delta)
            return True
        channel, self._recipient = header
        self._message += self._pending[: at + len(MESSAGE)]
        self._pending = self._pending[at + len(MESSAGE) :]
        self._where, self._body_at = Where.BODY, len(self._message)
        if self._recipient:
            self._sink = None  # a call: kept whole, to be sent or given back as written
        else:
            self._sink = "reasoning" if channel == "analysis" else "content"
            self._message = ""
        return True

    def _read_body(self, delta: Delta) -> bool:
        found = [(at, marker) for marker in MARKERS if (at := self._pending.find(marker)) >= 0]
        if not found:
            kept = max(held_back(self._pending, marker) for marker in MARKERS)
            text = self._pending[: len(self._pending) - kept]
            self._pending = self._pending[len(text) :]
            self._take(delta, text)
            return False
        at, marker = min(found)
        text, self._pending = self._pending[:at], self._pending[at + len(marker) :]
        if marker not in CLOSERS:  # a header's marker inside a message's text
            self._take(delta, text)
            self._pending = marker + self._pending
            self._raw(delta)
            return True
        if self._sink is not None:
            self._emit(delta, self._sink, text)
        else:
            self._message += text
            arguments = self._message[self._body_at :]
            self._message += marker
            self._close_call(delta, arguments)
        self._message, self._where = "", Where.BETWEEN
        return True

    def _take(self, delta: Delta, text: str) -> None:
        """Part of a message's text: streamed to its channel, or kept for its call."""
        if self._sink is None:
            self._message += text
        else:
            self._emit(delta, self._sink, text)

    def _close_call(self, delta: Delta, arguments: str) -> None:
        """A call's message is whole: a call if it is to an offered function and its
        arguments are a JSON object, else content as written."""
        name = self._recipient.removeprefix(FUNCTIONS)
        offered = self._recipient.startswith(FUNCTIONS) and name in self.tool_names
        call = call_of(name, arguments) if offered else None
        if call is None:
            delta.content += self._message
        else:
            send_call(delta, self.calls, call)
        self._message = ""

    def _raw(self, delta: Delta) -> None:
        """Not harmony from here on: the message so far and all that follows is content."""
        delta.content += self._message
        self._message = ""
        self._where = Where.RAW

    @staticmethod
    def _emit(delta: Delta, sink: str, text: str) -> None:
        if sink == "reasoning":
            delta.reasoning += text
        else:
            delta.content += text


def _may_be_header(head: str, needs_role: bool, whole: bool) -> bool:
    """Whether ``head`` (a header's text so far; ``whole``: up to its ``<|message|>``)
    can still be a header: short, with no marker but a channel's and a constraint's,
    starting with the role where one is due, then with a recipient or the channel."""
    if len(head) > MAX_HEADER_CHARS:
        return False
    if not whole:  # what may be a marker's start is not known yet
        head = head[: len(head) - max(held_back(head, marker) for marker in MARKERS)]
    if any(marker in head for marker in MARKERS if marker not in (CHANNEL, CONSTRAIN)):
        return False
    if needs_role:
        if not (head.startswith(ROLE) or (not whole and ROLE.startswith(head))):
            return False
        head = head[len(ROLE) :]
    lead = head.lstrip()
    return not lead or any(
        lead.startswith(start) or start.startswith(lead) for start in (CHANNEL, "to=")
    )


def _parsed_header(head: str) -> tuple[str, str] | None:
    """(channel, recipient) of a header's text after the role, or None when it names no
    known channel or has words that are neither a recipient nor a content type."""
    before, sep, after = head.partition(CHANNEL)
    if not sep or CHANNEL in after:
        return None
    words_before = before.split()
    words_after = after.replace(CONSTRAIN, " ").split()
    if not words_after or words_after[0] not in CHANNELS:
        return None
    recipients = [w[3:] for w in words_before + words_after[1:] if w.startswith("to=")]
    others = [w for w in words_before if not w.startswith("to=")]
    if others or len(recipients) > 1 or any(not r for r in recipients):
        return None
    return words_after[0], recipients[0] if recipients else ""


def control_token_in(text: str) -> str | None:
    """The first of harmony's markers that ``text`` spells, if any."""
    found = [(at, marker) for marker in MARKERS if (at := text.find(marker)) >= 0]
    return min(found)[1] if found else None
