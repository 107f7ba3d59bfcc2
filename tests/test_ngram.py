"""N-gram prompt lookup: which earlier occurrence it copies from, and how much."""

from __future__ import annotations

import time

import numpy as np
import pytest

from updraft.speculative.ngram import NgramProposer


def test_proposes_the_tokens_that_followed_the_suffix():
    proposer = NgramProposer(num_speculative_tokens=3)
    assert proposer.match([5, 6, 7, 8, 9, 1, 5, 6]) == [7, 8, 9]


def test_the_most_recent_occurrence_wins():
    proposer = NgramProposer(num_speculative_tokens=2, max_ngram=2)
    # "1 2" occurs twice before the suffix; the later one is followed by 40 41.
    assert proposer.match([1, 2, 30, 31, 1, 2, 40, 41, 9, 1, 2]) == [40, 41]


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one():
    proposer = NgramProposer(num_speculative_tokens=2, max_ngram=3)
    # "7 1 2" matches at the start; "1 2" alone matches more recently.
    assert proposer.match([7, 1, 2, 30, 31, 8, 1, 2, 40, 41, 7, 1, 2]) == [30, 31]


def test_max_ngram_caps_the_suffix_length():
    proposer = NgramProposer(num_speculative_tokens=2, max_ngram=2)
    # With n <= 2 the most recent "1 2" is the one to copy from.
    assert proposer.match([7, 1, 2, 30, 31, 8, 1, 2, 40, 41, 7, 1, 2]) == [40, 41]


def test_min_ngram_refuses_shorter_matches():
    tokens = [4, 9, 1, 3, 5, 1]  # only the single token 1 recurs
    assert NgramProposer(num_speculative_tokens=2, min_ngram=1).match(tokens) == [3, 5]
    assert NgramProposer(num_speculative_tokens=2, min_ngram=2).match(tokens) == []


@pytest.mark.parametrize("tokens", [[], [3], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]])
def test_no_earlier_occurrence_proposes_nothing(tokens):
    assert NgramProposer(num_speculative_tokens=4).match(tokens) == []


def test_proposal_is_truncated_to_k():
    proposer = NgramProposer(num_speculative_tokens=2)
    assert proposer.match([1, 2, 3, 4, 5, 6, 1, 2]) == [3, 4]


def test_proposal_is_truncated_at_the_end_of_the_sequence():
    proposer = NgramProposer(num_speculative_tokens=5)
    # The match is followed only by 8 and the suffix itself.
    assert proposer.match([3, 4, 8, 3, 4]) == [8, 3, 4]
    # A run of one token matches itself one step back: a single token follows it.
    assert proposer.match([9, 9]) == [9]


def test_accepts_a_numpy_array():
    proposer = NgramProposer(num_speculative_tokens=2)
    assert proposer.match(np.array([5, 6, 7, 5, 6])) == [7, 5]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2.0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "min_ngram": 0}, "min_ngram"),
        ({"num_speculative_tokens": 2, "min_ngram": 3, "max_ngram": 2}, "max_ngram"),
        ({"num_speculative_tokens": 2, "max_ngram": 0}, "max_ngram"),
    ],
)
def test_invalid_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"NgramProposer\.{field} must be"):
        NgramProposer(**kwargs)


def test_a_batch_of_long_sequences_is_fast():
    # 64 requests of 4k tokens each step must not cost a noticeable share of a decode step.
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 32000, 4096).tolist() for _ in range(64)]
    proposer = NgramProposer(num_speculative_tokens=4)
    start = time.perf_counter()
    for tokens in sequences:
        proposer.match(tokens)
    assert time.perf_counter() - start < 1.0
