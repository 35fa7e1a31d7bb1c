"""``SamplerOutput``: what one sampler call returns (its own module: the sampler and the logprob
helpers both name it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplerOutput:
    """One token per sampled row, on the sampling device (``host_token_ids`` aside)."""

    token_ids: torch.Tensor  # int64 [B]
    # Only when some row asked for logprobs: [B, 1 + k] ids/logprobs (column 0 = sampled), ranks [B].
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None
    # The fused GPU sampler may also store token_ids in pinned host memory (pagedllm/zero_copy.py);
    # readable once the stream has passed the sampler, e.g. after an event recorded behind it.
    host_token_ids: torch.Tensor | None = None
