"""N-gram (prompt lookup) proposer: the request's own text predicts its continuation.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n tokens are looked up
in the request's earlier tokens (prompt and output); at the first (earliest) occurrence of the
longest n that matches, the tokens that followed it are the drafts (up to k, fewer at the end).
This is vLLM's ``ngram`` method; it wins when the output copies from the prompt (editing,
summarising with quotes, code) and costs nothing on the device.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from pagedllm.spec_decode.interface import ProposeInput


def ngram_lookup(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to ``k`` tokens that followed the earliest earlier occurrence of the longest suffix of
    ``token_ids`` of length in [min_n, max_n]; empty when none occurs. Cost: one O(L) compare for
    the last token, then O(candidates * n) for the rest of each n (numpy, no loop over positions)."""
    num_tokens = len(token_ids)
    if num_tokens < min_n + 1:
        return token_ids[:0]
    # Candidate ends: earlier positions holding the last token; each needs a token after it.
    ends = np.flatnonzero(token_ids[: num_tokens - 1] == token_ids[-1])
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        starts = ends[ends >= n - 1] - (n - 1)
        if not len(starts):
            continue
        if n > 1:
            windows = token_ids[starts[:, None] + np.arange(n - 1)]
            starts = starts[(windows == token_ids[num_tokens - n : num_tokens - 1]).all(axis=1)]
        if len(starts):
            first = int(starts[0]) + n
            return token_ids[first : first + k]
    return token_ids[:0]


class NgramProposer:
    """Stateless apart from its settings. Cost per step: ``ngram_lookup`` per request."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, requests: list[ProposeInput]) -> dict[str, list[int]]:
        drafts = {}
        for r in requests:
            found = ngram_lookup(r.token_ids, self.min_n, self.max_n, self.k)
            if len(found):
                drafts[r.req_id] = found.tolist()
        return drafts

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """Nothing is kept per request."""
