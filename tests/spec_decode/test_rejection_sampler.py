"""The verification of drafts is exact in distribution: the first two output tokens of a request
whose first token was drafted follow the target's joint distribution, computed by brute force on
a 5-token vocabulary, for plain temperature-1 sampling and with temperature + top-k + top-p.

The step is emulated as the runner runs it: logits at the known position and after the draft,
one draw per position from the real ``Sampler``, ``accept_drafts``; a rejected draft's second
token is drawn in the next step, from the logits after the token actually emitted. A sampler
that accepts a draft when it is the target's most likely token (right in greedy, wrong at
temperature 1) fails the same test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedllm.sample.history import TokenHistory
from pagedllm.sample.sampler import Sampler, build_sampling_metadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.rejection_sampler import accept_drafts

V = 5
N = 20_000
torch.manual_seed(0)
LOGITS_0 = torch.randn(V) * 1.5  # the first position
LOGITS_1 = torch.randn(V, V) * 1.5  # LOGITS_1[t]: the position after token t


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Brute force: temperature, then top-k, then top-p (smallest set reaching top_p), renormalised."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(V, dtype=torch.bool)
    k = params.top_k if params.top_k > 0 else V
    mass = 0.0
    for rank, t in enumerate(order.tolist()):
        if rank >= k or mass >= params.top_p:
            break
        keep[t] = True
        mass += float(probs[t])
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def draw(sampler: Sampler, logits: torch.Tensor, params: SamplingParams) -> list[int]:
    history = TokenHistory.from_lists([[0]] * len(logits), [[] for _ in range(len(logits))])
    return sampler(logits.clone(), build_sampling_metadata([params] * len(logits), history, "cpu", V)).token_ids.tolist()


def speculative_pairs(params: SamplingParams, accept_if_most_likely: bool = False) -> list[tuple[int, int]]:
    """N requests, each with one random draft for its first token: their first two tokens."""
    sampler = Sampler(seed=1)
    rng = np.random.default_rng(2)
    drafts = rng.integers(0, V, N).tolist()
    # One verifying step: position 0 and the position after the draft.
    x0 = draw(sampler, LOGITS_0.expand(N, V), params)
    x1 = draw(sampler, LOGITS_1[drafts], params)
    most_likely = int(LOGITS_0.argmax())
    pairs, redo = [None] * N, []
    for i in range(N):
        if accept_if_most_likely:
            got = [drafts[i], x1[i]] if drafts[i] == most_likely else [x0[i]]
        else:
            got = accept_drafts([x0[i], x1[i]], [drafts[i]])
        if len(got) == 2:
            pairs[i] = tuple(got)
        else:
            redo.append((i, got[0]))
    # The next step: a rejected request draws its second token after the token it emitted.
    x1_next = draw(sampler, LOGITS_1[[t for _, t in redo]], params)
    for (i, t0), t1 in zip(redo, x1_next):
        pairs[i] = (t0, t1)
    return pairs


def chi_square_exceeds(pairs: list[tuple[int, int]], params: SamplingParams) -> tuple[float, float]:
    """Pearson's statistic of the pairs against the brute-force joint, and its 99.99% quantile
    (Wilson-Hilferty); cells expecting under 5 are pooled."""
    p0 = target_probs(LOGITS_0, params)
    joint = torch.stack([p0[t] * target_probs(LOGITS_1[t], params) for t in range(V)]).flatten().double()
    counts = np.bincount([a * V + b for a, b in pairs], minlength=V * V)
    expected = joint.numpy() * N
    assert counts[expected == 0].sum() == 0, "a token outside the target's support was emitted"
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.719  # the standard normal's 99.99% quantile
    return stat, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4, top_p=0.9),
], ids=["t1", "t0.7_topk_topp"])
def test_output_follows_the_target_distribution(params):
    stat, limit = chi_square_exceeds(speculative_pairs(params), params)
    assert stat < limit


def test_accepting_the_most_likely_draft_is_caught():
    params = SamplingParams(temperature=1.0)
    stat, limit = chi_square_exceeds(speculative_pairs(params, accept_if_most_likely=True), params)
    assert stat > limit


def test_accept_drafts_stops_at_the_first_mismatch():
    assert accept_drafts([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert accept_drafts([5, 9, 7, 8], [5, 6, 7]) == [5, 9]
    assert accept_drafts([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert accept_drafts([3], []) == [3]
