"""The beam search's drivers and early_stopping, on a toy distribution (no model): every beam's
next token is EOS (0) with p=0.5, 1 with 0.3 or 2 with 0.2."""

from __future__ import annotations

import asyncio
import math

import pytest

from pagedllm.beam_search import BeamSearchParams, run_beam_search, run_beam_search_async
from pagedllm.outputs import Logprob

EOS = 0
CANDIDATES = {EOS: Logprob(math.log(0.5), 1), 1: Logprob(math.log(0.3), 2), 2: Logprob(math.log(0.2), 3)}


def _search(early_stopping, max_tokens: int = 6):
    calls = []

    def step(beams):
        calls.append(len(beams))
        return [dict(CANDIDATES) for _ in beams]

    params = BeamSearchParams(beam_width=2, max_tokens=max_tokens, early_stopping=early_stopping)
    [out] = run_beam_search(step, [[5]], params, EOS, max_model_len=64)
    return out.sequences, len(calls)


def test_early_stopping_true_stops_once_beam_width_beams_finished():
    sequences, steps = _search(True)
    assert steps == 2  # one EOS child after step 1, two more after step 2
    assert [s.finish_reason for s in sequences] == ["stop", "stop"]


def test_early_stopping_never_searches_to_max_tokens_and_false_in_between():
    _, never_steps = _search("never")
    _, heuristic_steps = _search(False)
    assert never_steps == 6
    assert 2 < heuristic_steps < never_steps


def test_early_stopping_is_validated():
    with pytest.raises(ValueError, match="^early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=3, early_stopping="soon")


def test_async_driver_gives_the_sync_result():
    params = BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=0.7)

    async def step(beams):
        await asyncio.sleep(0)
        return [dict(CANDIDATES) for _ in beams]

    sync = run_beam_search(lambda beams: [dict(CANDIDATES) for _ in beams], [[5], [7, 8]], params, EOS, 64)
    got = asyncio.run(run_beam_search_async(step, [[5], [7, 8]], params, EOS, 64))
    assert [[(s.tokens, s.cum_logprob) for s in o.sequences] for o in got] == \
        [[(s.tokens, s.cum_logprob) for s in o.sequences] for o in sync]
