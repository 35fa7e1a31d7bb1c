"""Logprobs: the chosen token's log-probability and rank plus the top-k, for samples and prompts.

vLLM's default ("raw logprobs"): log_softmax of the model's logits before any processing
(no penalties, bias, masks or temperature). A rank is 1 + the number of tokens strictly more
likely, counted as vLLM does (``#{logprob >= chosen}``, so a tie shares the worse rank).
Cost: O(N * V) for the rank count plus one topk(k) over [N, V].
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedllm.core.sched_output import TokenLogprobs
from pagedllm.sample.output import SamplerOutput
from pagedllm.sampling_params import SamplingParams


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


def sampled_logprobs_rows(host: SamplerOutput, params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    """Per sampling row: the TokenLogprobs of its sampled token (chosen token, then its request's
    top-k), or None where the request asked for none. ``host`` holds the sampler's logprob
    tensors on the host (``logprobs`` is not None). Cost: O(rows * k) host work."""
    ids = host.logprob_token_ids.tolist()
    lps = host.logprobs.tolist()
    ranks = host.sampled_ranks.tolist()
    return [None if p.logprobs is None else to_token_logprobs(ids[j], lps[j], ranks[j], p.logprobs)
            for j, p in enumerate(params)]


class PromptLogprobs:
    """Logprobs of prompt tokens, reported as the prefill chunks that predict them are computed.

    Position p of a prompt predicts prompt token p + 1 (the last prompt position samples instead).
    Invariant: ``done[req_id]`` is the prompt position up to which that request's logprobs were
    reported; it survives preemption (positions are never reported twice) and is dropped when the
    request finishes. Cost per step: one LM-head pass over the positions reported, in chunks.
    """

    def __init__(self) -> None:
        self.done: dict[str, int] = {}

    def forget(self, req_id: str) -> None:
        self.done.pop(req_id, None)

    def compute(self, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor], batch,
                req_ids: list[str], query_start: np.ndarray, num_scheduled: dict[str, int]) -> dict[str, list[TokenLogprobs]]:
        """For the step whose hidden states are ``hidden`` (request i's tokens start at row
        ``query_start[i]``): the prompt logprobs each request with ``prompt_logprobs`` gets now.
        ``batch`` is the runner's InputBatch, its ``num_computed_tokens`` already past this step."""
        out = {}
        for i, req_id in enumerate(req_ids):
            row = batch.req_id_to_row[req_id]
            k = batch.params[row].prompt_logprobs
            if k is None:
                continue
            end = int(batch.num_computed_tokens[row])
            chunk_start = end - num_scheduled[req_id]
            start = max(chunk_start, self.done.get(req_id, 0))
            stop = min(end, int(batch.num_prompt_tokens[row]) - 1)
            if start >= stop:
                continue
            first = int(query_start[i]) + start - chunk_start
            next_ids = torch.from_numpy(batch.token_ids[row, start + 1 : stop + 1].copy()).to(hidden.device)
            out[req_id] = prompt_logprobs(hidden[first : first + stop - start], compute_logits, next_ids, k)
            self.done[req_id] = stop
        return out
