"""Tokenizer loading and incremental detokenization with stop strings."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import ahocorasick
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

# Texts from this many characters are encoded without the GIL (below it, the call costs
# less than handing the GIL over and back).
RELEASE_GIL_FROM = 2048


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
    def backend(self) -> HFTokenizer:
        """The ``tokenizers`` object, for its streaming decoder."""
        return self._tokenizer

    @cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token decodes to: its vocabulary entry's
        length (byte-level entries spell one character per byte), plus one for a space a
        decoder may add. A text longer than ``n * max_token_chars`` has over n tokens."""
        return max(map(len, self._tokenizer.get_vocab(with_added_tokens=True)), default=0) + 1

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens=False`` leaves out the BOS (or
        other marks) the tokenizer adds, for a text that spells its own, as a rendered
        chat does. A long text goes through ``encode_batch``, which drops the GIL while
        it works (``encode`` holds it: 86,000 characters held every other thread, the
        engine's included, for 26 ms here)."""
        if len(text) < RELEASE_GIL_FROM:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


# Ids that still decode to no complete character after this many are invalid bytes: they
# come out as replacement characters instead of widening every later decode.
MAX_PENDING_IDS = 8
CONTEXT_IDS = 6  # earlier ids a decode starts from, so each piece decodes like the rest


class Detokenizer:
    """Turns a request's output ids into text, a piece at a time, and finds stop strings.

    ``tokenizers``' ``DecodeStream`` decodes each id against a short window of recent
    ids, so a token costs the same at the end of a long output as at its start, and it
    holds back an id that ends in an incomplete UTF-8 character until a later one
    completes it. With stop strings, the last ``len(longest stop) - 1`` characters are
    held back too, since they may be the start of a stop string.

    Stop strings are found by one Aho-Corasick automaton over the new text and the held
    back characters, so a token costs the same whether a request has one stop string or
    many. The first stop string the text completes ends it (the longest, if several end
    at the same character), and the text is cut just before that string (after it, with
    ``include_stop``).
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        prompt_ids: list[int],
        stop: list[str],
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.stream = None if tokenizer is None else self._stream(prompt_ids)
        self.held: list[int] = []  # ids the stream has not turned into text yet
        self.pending = ""  # decoded text not yet taken
        self.pieces: list[str] = []  # the text taken so far, append-only
        self.matcher = _automaton(stop) if stop else None
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.stopped = False  # a stop string was found; nothing more is added

    def _stream(self, context_ids: list[int]) -> DecodeStream:
        return DecodeStream(
            ids=list(context_ids[-CONTEXT_IDS:]), skip_special_tokens=self.skip_special_tokens
        )

    def add(self, token_id: int, find_stops: bool = True) -> str | None:
        """Append one id; returns the stop string if the text now contains one (the text
        is then cut there). ``find_stops`` False (before min_tokens): none is looked for
        in this id's text."""
        if self.stream is None or self.stopped:
            return None
        piece = self.stream.step(self.tokenizer.backend, token_id)
        if piece is None:
            self.held.append(token_id)
            if len(self.held) < MAX_PENDING_IDS:
                return None
            piece = self.tokenizer.decode(self.held, self.skip_special_tokens)
            self.stream = self._stream(self.held)
        self.held = []
        start = max(len(self.pending) - self.hold, 0)
        self.pending += piece
        if self.matcher is None or not find_stops:
            return None
        matches = self.matcher.iter(self.pending, start)
        first_end, stop = next(matches, (None, None))
        if stop is None:
            return None
        for end, other in matches:
            if end != first_end:
                break
            stop = max(stop, other, key=len)
        self.pending = self.pending[: first_end + 1 - (0 if self.include_stop else len(stop))]
        self.stopped = True
        return stop

    def take(self, finished: bool) -> str:
        """New text since the last call, holding back a possible stop-string start. When
        the request has finished, ids held back as incomplete characters are flushed."""
        if finished and self.held and not self.stopped:
            self.pending += self.tokenizer.decode(self.held, self.skip_special_tokens)
            self.held = []
        end = len(self.pending) if finished else max(len(self.pending) - self.hold, 0)
        piece, self.pending = self.pending[:end], self.pending[end:]
        if piece:
            self.pieces.append(piece)
        return piece


def _automaton(words: list[str]) -> ahocorasick.Automaton:
    automaton = ahocorasick.Automaton()
    for word in words:
        automaton.add_word(word, word)
    automaton.make_automaton()
    return automaton
