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

    Cost: one host->device copy of the mask rows (the host buffer may be reused as soon as this
    returns: a copy from pageable memory is staged before the call returns), when some logits rows
    are unconstrained one fill of a full-height mask, and one masking launch over the rows."""
    import xgrammar as xgr  # imported on the first constrained step, not at engine start

    rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
    words = torch.from_numpy(np.ascontiguousarray(bitmask, dtype=np.int32))
    if logits.device.type != "cpu":
        words = words.to(logits.device, non_blocking=True)
    if rows != list(range(logits.shape[0])):
        # xgrammar indexes the mask by logits row: spread the rows over a mask that allows all.
        full = torch.full((logits.shape[0], words.shape[1]), -1, dtype=torch.int32, device=logits.device)
        full[torch.tensor(rows, dtype=torch.int64, device=logits.device)] = words
        words = full
    xgr.apply_token_bitmask_inplace(logits, words, indices=rows, vocab_size=min(logits.shape[-1], words.shape[1] * 32))
