"""The n-gram proposer: the longest suffix of length in [min, max], its earliest earlier occurrence."""

from __future__ import annotations

import numpy as np

from pagedllm.spec_decode.interface import ProposeInput
from pagedllm.spec_decode.ngram import NgramProposer, ngram_lookup


def lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return ngram_lookup(np.asarray(tokens, dtype=np.int64), min_n, max_n, k).tolist()


def test_the_longest_matching_suffix_wins_over_an_earlier_shorter_one():
    #        0  1  2  3  4  5  6  7  8  9 10
    tokens = [7, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    assert lookup(tokens, 1, 3, 2) == [4, 5]  # "1 2 3" at 3..5, not "3" at 1 (-> 9)
    assert lookup(tokens, 1, 1, 2) == [9, 1]  # only 1-grams: the earliest "3"


def test_no_match_below_min_and_at_most_k_tokens():
    assert lookup([1, 2, 3, 4, 5], 1, 3, 3) == []
    assert lookup([1, 2, 9, 1, 2], 3, 3, 3) == []  # "9 1 2" never occurred before
    assert lookup([1, 2, 9, 1, 2], 2, 3, 5) == [9, 1, 2]  # k=5, only 3 tokens follow
    assert lookup([4], 1, 3, 2) == []


def test_the_suffix_itself_is_not_a_match_but_overlaps_are():
    assert lookup([5, 5, 5], 1, 2, 3) == [5]  # "5 5" at 0..1 is followed by one 5
    assert lookup([6, 6], 2, 2, 3) == []


def test_proposer_drafts_per_request_and_skips_requests_without_a_match():
    proposer = NgramProposer(num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=4)
    reqs = [ProposeInput("a", np.array([1, 2, 3, 4, 1, 2]), 4), ProposeInput("b", np.array([1, 2, 3]), 3)]
    assert proposer.propose(reqs) == {"a": [3, 4]}


def brute_force_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, position by position: for n from max_n down, the earliest earlier window
    equal to the last n tokens (it must be followed by a token)."""
    num_tokens = len(tokens)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        for start in range(num_tokens - n):
            if tokens[start : start + n] == tokens[num_tokens - n :]:
                return tokens[start + n : start + n + k]
    return []


def test_lookup_matches_the_definition_on_random_sequences():
    rng = np.random.default_rng(0)
    for trial in range(400):
        vocab = int(rng.integers(2, 6))
        tokens = rng.integers(0, vocab, size=int(rng.integers(1, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        assert lookup(tokens, min_n, max_n, k) == brute_force_lookup(tokens, min_n, max_n, k), (trial, tokens, min_n,
                                                                                              max_n, k)
