"""Reasoning read out of a reply: ``<think>...</think>`` goes to ``reasoning_content``,
what follows to ``content``, whole or as a stream of deltas, however the text is cut
(a tag split across tokens or steps is held back until it is known).

Where a reply starts is read from the prompt the chat template rendered:

* inside reasoning, when the prompt leaves a ``<think>`` open (DeepSeek-R1's templates,
  DeepSeek V3.1's with thinking on): the reply is reasoning until ``</think>``, with no
  opening tag of its own;
* after it, when the prompt ends with a closed ``<think>...</think>`` (Qwen3 with
  ``enable_thinking: false``): the reply is all content;
* else the model may open ``<think>`` itself (Qwen3), first thing in its reply; a reply
  that begins otherwise is all content.

The parsers are named as vLLM names them; all of them read ``<think>`` tags. A chat
template that speaks of thinking turns one on by default (``default_reasoning``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from updraft.serve.parsers.tools import held_back

THINK_TAGS = ("<think>", "</think>")
REASONING_PARSERS: dict[str, tuple[str, str]] = {
    "qwen3": THINK_TAGS,
    "deepseek_r1": THINK_TAGS,
    "deepseek_v3": THINK_TAGS,
}
# What in a chat template shows that its model thinks before it answers.
THINKING_MARKERS = ("<think>", "enable_thinking", "reasoning_content")


def default_reasoning(template_source: str) -> str | None:
    """The reasoning parser for a chat template: deepseek_r1 for DeepSeek's turn
    markers, qwen3 for others that show thinking, None for a template that does not."""
    if not any(marker in template_source for marker in THINKING_MARKERS):
        return None
    return "deepseek_r1" if "<｜Assistant｜>" in template_source else "qwen3"


class Start(enum.Enum):
    INSIDE = "inside"  # the prompt opened the reasoning
    MAYBE = "maybe"  # the reply may open it
    AFTER = "after"  # the prompt closed it, or the reply began with content


def reply_start(prompt: str, tags: tuple[str, str]) -> Start:
    """Where a reply to ``prompt`` starts: inside reasoning the prompt left open, after
    reasoning the prompt's end closed, or where the model may open it."""
    opened, closed = prompt.rfind(tags[0]), prompt.rfind(tags[1])
    if opened > closed:
        return Start.INSIDE
    if closed >= 0 and prompt.rstrip().endswith(tags[1]):
        return Start.AFTER
    return Start.MAYBE


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    def __init__(self, tags: tuple[str, str], start: Start) -> None:
        self.opening, self.closing = tags
        self._state = start
        self._pending = ""  # text held back: maybe a tag, or whitespace before content
        self._trim = False  # drop the whitespace that follows the closing tag

    def feed(self, text: str) -> Split:
        split = Split()
        self._pending += text
        self._advance(split)
        return split

    def finish(self) -> Split:
        split = Split()
        pending, self._pending = self._pending, ""
        if self._state is Start.INSIDE:
            split.reasoning = pending
        elif not self._trim:
            split.content = pending
        return split

    def _advance(self, split: Split) -> None:
        if self._state is Start.MAYBE:
            visible = self._pending.lstrip()
            if len(visible) < len(self.opening) and self.opening.startswith(visible):
                return  # whitespace, or what may be the opening tag: not known yet
            if not visible.startswith(self.opening):
                self._state = Start.AFTER
            else:
                self._state = Start.INSIDE
                self._pending = visible[len(self.opening) :]
        if self._state is Start.INSIDE:
            at = self._pending.find(self.closing)
            if at < 0:
                taken = len(self._pending) - held_back(self._pending, self.closing)
                split.reasoning += self._pending[:taken]
                self._pending = self._pending[taken:]
                return
            split.reasoning += self._pending[:at]
            self._pending = self._pending[at + len(self.closing) :]
            self._state, self._trim = Start.AFTER, True
        if self._trim:
            self._pending = self._pending.lstrip()
            self._trim = not self._pending
        split.content += self._pending
        self._pending = ""
