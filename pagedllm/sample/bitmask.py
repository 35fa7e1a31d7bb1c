"""Token bitmasks (structured output): which token ids each logits row may produce.

A bitmask row packs the vocabulary in int32 words, bit ``t % 32`` of word ``t // 32`` set where
token ``t`` is allowed (xgrammar's and vLLM's format). The runner applies it between the model's
logits and the sampler (``ModelRunner.sample_tokens(grammar_output)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class GrammarOutput:
    """The bitmasks of one step: ``bitmask[j]`` belongs to the j-th logits row of the requests in
    ``req_ids`` (in that order; a request verifying d drafts has d + 1 rows, in position order).
    Cost: ``len(rows) * ceil(vocab / 32)`` int32 words."""

    req_ids: list[str]
    bitmask: np.ndarray  # int32 [rows, ceil(vocab / 32)]


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: np.ndarray) -> None:
    """Set ``logits[rows[j], t] = -inf`` wherever bit t of ``bitmask[j]`` is clear, in place.
    Cost: one unpack of the mask on the logits' device and one masked fill of the rows."""
    words = torch.from_numpy(np.ascontiguousarray(bitmask, dtype=np.int32)).to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : logits.shape[-1]]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
