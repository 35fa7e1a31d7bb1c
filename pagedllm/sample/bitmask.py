"""Token bitmasks (structured output): which token ids each logits row may produce.

A bitmask row packs the vocabulary in int32 words, bit ``t % 32`` of word ``t // 32`` set where
token ``t`` is allowed (xgrammar's and vLLM's format). The runner applies it between the model's
logits and the sampler (``ModelRunner.sample_tokens(grammar_output)``) with xgrammar's kernel:
one Triton launch on the GPU, a C++ loop on the CPU.
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


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor | list[int], bitmask: np.ndarray) -> None:
    """Set ``logits[rows[j], t] = -inf`` wherever bit t of ``bitmask[j]`` is clear, in place.

    Cost: a host-side mask of the logits' height (rows not in ``rows`` allow everything; a memset
    of ``len(logits) * ceil(vocab / 32)`` words when some rows are unconstrained), one
    host->device copy of it (from pageable memory: staged before the call returns, so the caller
    may reuse ``bitmask`` at once) and one masking launch over ``rows``."""
    import xgrammar as xgr  # imported on the first constrained step, not at engine start

    rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
    num_rows, num_words = logits.shape[0], bitmask.shape[1]
    if rows == list(range(num_rows)):
        words = np.ascontiguousarray(bitmask, dtype=np.int32)
        indices = None
    else:  # xgrammar indexes the mask by logits row: spread the rows over a mask that allows all
        words = np.full((num_rows, num_words), -1, dtype=np.int32)
        words[rows] = bitmask
        indices = rows
    mask = torch.from_numpy(words)
    if logits.device.type != "cpu":
        mask = mask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, mask, indices=indices, vocab_size=min(logits.shape[-1], num_words * 32))
