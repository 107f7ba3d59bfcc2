"""Outputs cost the same at every step: deltas are what is new, whole-sequence fields are
read from append-only lists as of when the output was made, and the detokenizer's
window stays small however long the output grows or however broken its bytes are."""

from __future__ import annotations

import random

from tests.helpers import greedy
from updraft import LLM
from updraft.demo import DEMO_MODEL_DIR
from updraft.tokenizer import MAX_PENDING_IDS, Detokenizer, Tokenizer


def test_deltas_add_up_and_every_output_stays_as_it_was_made():
    llm = LLM()
    params = greedy(40, logprobs=True)
    seen = []
    for output in llm.generate_stream("def fibonacci(n):", params):
        completion = output.outputs[0]
        seen.append((output, completion.text, list(completion.token_ids)))
    final = seen[-1][0].outputs[0]
    assert final.text == "".join(o.outputs[0].delta_text for o, _, _ in seen)
    assert final.token_ids == [t for o, _, _ in seen for t in o.outputs[0].delta_token_ids]
    assert final.logprobs == [lp for o, _, _ in seen for lp in o.outputs[0].delta_logprobs]
    assert len(final.token_ids) == 40
    # Read after the request finished, each earlier output still says what it said.
    for output, text, token_ids in seen:
        assert output.outputs[0].text == text
        assert output.outputs[0].token_ids == token_ids
    assert [len(ids) for _, _, ids in seen] == list(range(1, 41))


def test_a_long_output_detokenizes_piece_by_piece_to_the_whole_decode():
    tokenizer = Tokenizer.from_dir(DEMO_MODEL_DIR)
    rng = random.Random(0)
    ids = [rng.randrange(1, 4096) for _ in range(5000)]
    detokenizer = Detokenizer(tokenizer, [1, 2, 3], [])
    pieces = []
    for token_id in ids:
        detokenizer.add(token_id)
        assert len(detokenizer.held) < MAX_PENDING_IDS
        pieces.append(detokenizer.take(False))
    pieces.append(detokenizer.take(True))
    assert "".join(pieces) == tokenizer.decode(ids)


def test_invalid_bytes_come_out_as_replacement_characters_instead_of_piling_up():
    tokenizer = Tokenizer.from_dir(DEMO_MODEL_DIR)
    broken = next(i for i in range(4096) if tokenizer.decode([i]) == "\ufffd")
    detokenizer = Detokenizer(tokenizer, [1], [])
    text = ""
    for _ in range(100):
        detokenizer.add(broken)
        assert len(detokenizer.held) < MAX_PENDING_IDS
        text += detokenizer.take(False)
    text += detokenizer.take(True)
    assert text and set(text) == {"\ufffd"}


def test_stop_strings_are_found_across_pieces_and_cut():
    tokenizer = Tokenizer.from_dir(DEMO_MODEL_DIR)
    ids = tokenizer.encode("x = 1\nreturn value\n")
    detokenizer = Detokenizer(tokenizer, [1], ["return"])
    found = None
    text = ""
    for token_id in ids:
        found = detokenizer.add(token_id)
        text += detokenizer.take(found is not None)
        if found:
            break
    assert found == "return" and text == "x = 1\n"


def test_the_first_stop_string_completed_ends_the_text_and_the_longest_wins_a_tie():
    tokenizer = Tokenizer.from_dir(DEMO_MODEL_DIR)

    def stop_at(text: str, stops: list[str]) -> tuple[str | None, str]:
        detokenizer = Detokenizer(tokenizer, [1], stops)
        found, out = None, ""
        for token_id in tokenizer.encode(text):
            found = detokenizer.add(token_id)
            out += detokenizer.take(found is not None)
            if found:
                break
        return found, out

    assert stop_at("one two three", ["two three", "wo"]) == ("wo", "one t")
    assert stop_at("one two three", ["two", "o"]) == ("o", "")
    assert stop_at("a = bcd", ["bcd", "cd", "d"]) == ("bcd", "a = ")
    many = [f"never{i}" for i in range(31)] + ["three"]
    assert stop_at("one two three four", many) == ("three", "one two ")


def test_a_long_text_is_tokenized_without_holding_the_gil():
    """With a switch interval of a second, another thread runs during ``encode`` only if
    the tokenizer lets go of the GIL: counted, not timed."""
    import sys
    import threading
    import time

    from updraft.demo import DEMO_MODEL_DIR
    from updraft.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(DEMO_MODEL_DIR)
    text = "def add(a, b):\n    return a + b\n" * 3000  # about 100,000 characters
    count, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    spinner = threading.Thread(target=spin)
    try:
        spinner.start()
        time.sleep(0.01)  # hands the GIL to the spinner, which keeps it up to a second
        before = count[0]
        ids = tokenizer.encode(text)
        during = count[0] - before
    finally:
        stop.set()
        spinner.join()
        sys.setswitchinterval(interval)
    assert ids == tokenizer.backend.encode(text).ids
    assert during > 1000, f"the other thread ran {during} times while the text was tokenized"
