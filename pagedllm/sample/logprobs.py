"""Logprobs: the chosen token's log-probability and rank plus the top-k, for samples and prompts.

vLLM's default ("raw logprobs"): log_softmax of the model's logits before any processing
(no penalties, bias, masks or temperature). A rank is 1 + the number of tokens strictly more
likely, counted as vLLM does (``#{logprob >= chosen}``, so a tie shares the worse rank).
Cost: O(N * V) for the rank count plus one topk(k) over [N, V].
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.core.sched_output import TokenLogprobs


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [N, 1+k], logprobs [N, 1+k], ranks [N]); column 0 is ``token_ids``, then the top-k."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs >= chosen).sum(dim=-1)
    if k == 0:
        return token_ids.unsqueeze(1), chosen, ranks
    top_lp, top_ids = logprobs.topk(k, dim=-1)
    return torch.cat([token_ids.unsqueeze(1), top_ids], dim=1), torch.cat([chosen, top_lp], dim=1), ranks


def to_token_logprobs(ids: list[int], lps: list[float], rank: int, k: int) -> TokenLogprobs:
    """One position's TokenLogprobs from a row of ``gather_logprobs`` (trimmed to this row's k)."""
    return TokenLogprobs(ids[: 1 + k], lps[: 1 + k], [rank, *range(1, k + 1)])


def prompt_logprobs(
    hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor], next_ids: torch.Tensor, k: int,
    chunk: int = 256,
) -> list[TokenLogprobs]:
    """TokenLogprobs of ``next_ids[j]`` under the raw logits of ``hidden[j]``, computed ``chunk``
    positions at a time so that at most [chunk, V] float32 logits are live at once."""
    out: list[TokenLogprobs] = []
    for s in range(0, hidden.shape[0], chunk):
        lp = torch.log_softmax(compute_logits(hidden[s : s + chunk]).float(), dim=-1)
        ids, lps, ranks = gather_logprobs(lp, next_ids[s : s + chunk], k)
        out.extend(to_token_logprobs(i, v, r, k) for i, v, r in zip(ids.tolist(), lps.tolist(), ranks.tolist()))
    return out
