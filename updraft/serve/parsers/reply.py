"""One reply read as the server returns it: reasoning split off first (reasoning.py),
then tool calls read out of the content that follows (tool_parsers.py, tools.py). The
same reader takes a whole reply or its pieces as they stream, so the two agree."""

from __future__ import annotations

from updraft.serve.parsers.reasoning import ReasoningStream
from updraft.serve.parsers.tool_parsers import ReplyStream
from updraft.serve.parsers.tools import Delta, ToolCall


class ReplyReader:
    def __init__(self, reasoning: ReasoningStream | None, tools: ReplyStream | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @property
    def calls(self) -> list[ToolCall]:
        return [] if self.tools is None else self.tools.calls

    def feed(self, text: str) -> Delta:
        return self._read(text, finished=False)

    def finish(self, cut: bool = False) -> Delta:
        """What is left once the reply has ended (``cut``, by its length limit, reads the
        same here: a call that parses is sent)."""
        return self._read("", finished=True)

    def read_all(self, text: str, cut: bool = False) -> Delta:
        """A whole reply, as one delta."""
        return self.feed(text) + self.finish(cut)

    def _read(self, text: str, finished: bool) -> Delta:
        reasoning = ""
        if self.reasoning is not None:
            split = self.reasoning.feed(text)
            if finished:
                last = self.reasoning.finish()
                split.reasoning, split.content = (
                    split.reasoning + last.reasoning,
                    split.content + last.content,
                )
            reasoning, text = split.reasoning, split.content
        if self.tools is None:
            return Delta(content=text, reasoning=reasoning)
        delta = self.tools.feed(text)
        if finished:
            delta = delta + self.tools.finish()
        delta.reasoning = reasoning
        return delta
