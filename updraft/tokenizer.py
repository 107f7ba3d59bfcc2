"""Tokenizer loading and incremental detokenization with stop strings."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    """A checkpoint's tokenizer.json, through the ``tokenizers`` library."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer | None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as error:  # the library raises a bare Exception on bad files
            raise ValueError(f"cannot read tokenizer {path}: {error}") from error

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


# Ids that still end in an incomplete character after this many are invalid bytes: they
# come out as replacement characters instead of widening every later decode.
MAX_PENDING_IDS = 8
# Ids before the decode window are dropped once this many pile up.
MAX_KEPT_IDS = 64


class Detokenizer:
    """Turns a request's output ids into text, a piece at a time, and finds stop strings.

    Each id decodes only a short window of recent ids (between ``prefix_offset`` and the
    end), so a token costs the same at the end of a long output as at its start. A piece
    that ends in an incomplete UTF-8 character is held back until a later id completes
    it. With stop strings, the last ``len(longest stop) - 1`` characters are held back
    too, since they may be the start of a stop string.
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-6:])  # context so the first piece decodes like the rest
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.pending = ""  # decoded text not yet taken
        self.pieces: list[str] = []  # the text taken so far, append-only
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.stopped = False  # a stop string was found; nothing more is added

    def add(self, token_id: int) -> str | None:
        """Append one id; returns the stop string if the text now contains one (the text
        is then cut just before it)."""
        if self.tokenizer is None or self.stopped:
            return None
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        waiting = len(full) <= len(prefix) or full.endswith("\ufffd")
        if waiting and len(self.ids) - self.read_offset < MAX_PENDING_IDS:
            return None
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.prefix_offset > MAX_KEPT_IDS:
            del self.ids[: self.prefix_offset]
            self.prefix_offset, self.read_offset = 0, len(self.ids)
        start = max(len(self.pending) - self.hold, 0)
        self.pending += full[len(prefix) :]
        if not self.stop:
            return None
        found = [(i, stop) for stop in self.stop if (i := self.pending.find(stop, start)) != -1]
        if not found:
            return None
        index, stop = min(found)
        self.pending = self.pending[:index]
        self.stopped = True
        return stop

    def take(self, finished: bool) -> str:
        """New text since the last call, holding back a possible stop-string start. When
        the request has finished, ids held back as incomplete characters are flushed."""
        if finished and not self.stopped and self.read_offset < len(self.ids):
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
            self.pending += self.tokenizer.decode(self.ids[self.prefix_offset :])[len(prefix) :]
            self.read_offset = len(self.ids)
        end = len(self.pending) if finished else max(len(self.pending) - self.hold, 0)
        piece, self.pending = self.pending[:end], self.pending[end:]
        if piece:
            self.pieces.append(piece)
        return piece
