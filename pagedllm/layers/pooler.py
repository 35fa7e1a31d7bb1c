"""Pooling: a step's hidden states -> one vector per request (embedding models).

A request's prompt may be computed over several steps (chunked prefill of a causal model), so a
step pools each scheduled request's *chunk* into a partial (``chunk_partials``), partials of the
same request are merged across steps (``merge``), and the request's vector is finished when its
last chunk is computed (``finish``: the mean's division, Matryoshka truncation, L2 normalization).

Pooling types (sentence-transformers' ``1_Pooling/config.json`` modes, vLLM's names):
  - ``MEAN``: the mean over every prompt token (the partial is the chunk's sum, in float32);
  - ``CLS``: the first prompt token's hidden state (the partial of the chunk at position 0);
  - ``LAST``: the last prompt token's (decoder embedders such as Qwen3-Embedding).
All of a step's requests are pooled by one reduction (no per-request kernel launch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

POOLING_TYPES = ("MEAN", "CLS", "LAST")


class Pooler:
    """Pools a step's chunks; stateless (the runner keeps the partials of unfinished prompts).

    Cost per step: one segmented sum (MEAN) or one row gather (CLS / LAST) over the step's tokens,
    and for the finished requests a few element-wise ops over ``[finished, hidden]``."""

    def __init__(self, pooling_type: str) -> None:
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {pooling_type!r}")
        self.pooling_type = pooling_type

    def chunk_partials(self, hidden: torch.Tensor, query_start_loc: torch.Tensor, num_reqs: int) -> torch.Tensor:
        """``[num_reqs, hidden]`` float32: each request's partial over its tokens of this step
        (``hidden[query_start_loc[r]:query_start_loc[r + 1]]``)."""
        starts, ends = query_start_loc[:num_reqs].long(), query_start_loc[1 : num_reqs + 1].long()
        # index_select, not advanced indexing: the same gather, without the latter's per-call
        # overhead (tens of microseconds, milliseconds on a busy CPU's thread pool).
        if self.pooling_type == "CLS":
            return hidden.index_select(0, starts).float()
        if self.pooling_type == "LAST":
            return hidden.index_select(0, ends - 1).float()
        num_tokens = int(hidden.shape[0])
        token_req = torch.repeat_interleave(torch.arange(num_reqs, device=hidden.device), ends - starts,
                                            output_size=num_tokens)
        sums = torch.zeros(num_reqs, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        return sums.index_add_(0, token_req, hidden[:num_tokens].float())

    def merge(self, earlier: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
        """The partial of the tokens of ``earlier`` (previous steps) followed by those of ``chunk``."""
        if self.pooling_type == "MEAN":
            return earlier + chunk
        return earlier if self.pooling_type == "CLS" else chunk

    def finish(self, partials: torch.Tensor, num_prompt_tokens: torch.Tensor, dimensions: torch.Tensor,
               normalize: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` float32 vectors from the finished requests' merged partials: the mean's
        division by ``num_prompt_tokens`` (MEAN), then row ``i`` keeps its first ``dimensions[i]``
        entries (the rest are zeroed: the caller slices them off) and is L2-normalized over them
        where ``normalize[i]``."""
        vectors = partials / num_prompt_tokens.to(partials.dtype)[:, None] if self.pooling_type == "MEAN" else partials
        kept = torch.arange(vectors.shape[1], device=vectors.device)[None, :] < dimensions[:, None]
        vectors = vectors * kept
        return torch.where(normalize[:, None], F.normalize(vectors, p=2.0, dim=-1), vectors)
