"""Token bitmasks (structured output): which token ids each logits row may produce.

A bitmask row packs the vocabulary in int32 words, bit ``t % 32`` of word ``t // 32`` set where
token ``t`` is allowed (xgrammar's and vLLM's format). The runner applies it between the model's
logits and the sampler (``ModelRunner.sample_tokens(grammar_output)``) through a
``BitmaskApplier``: on the GPU one asynchronous copy from pinned memory and one Triton launch
(xgrammar's kernel), so the launch never waits for the forward still running on the stream; on
the CPU xgrammar's C++ loop.
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


class BitmaskApplier:
    """Masks logits rows with a step's bitmask (``apply``), for one device.

    Why pinned staging: a copy from pageable host memory is staged by the driver through a small
    buffer of its own, so a mask of a few hundred rows (1.5 MB at 256 rows of a 49k vocabulary)
    makes the host wait until the stream reaches the copy, i.e. until the forward in flight ends:
    the sample launch then costs the rest of the forward. From pinned memory the copy is queued
    and the call returns at once.

    Invariant (CUDA): ``_staging[k]`` is a pinned int32 buffer whose last copy to the device was
    followed by ``_copied[k]``; a buffer is rewritten only after its event completed (two buffers
    used in turn: the copy of the step before last is long done, so the wait is free). The
    caller's ``bitmask`` is never kept: it may be refilled as soon as ``apply`` returns.
    Cost: one host memcpy of the rows (plus a fill of allow-all rows for a mixed batch), one
    asynchronous host->device copy, one masking launch; on the CPU the same memcpy into a plain
    buffer, then the masking loop.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._staging: list[torch.Tensor | None] = [None, None]
        self._copied: list = [None, None]  # torch.cuda.Event per buffer, once used
        self._turn = 0

    def apply(self, logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
        """Set ``logits[rows[j], t] = -inf`` wherever bit t of ``bitmask[j]`` is clear, in place
        (``logits`` on this applier's device); rows not in ``rows`` are left as they are."""
        import xgrammar as xgr  # imported on the first constrained step, not at engine start

        num_rows, num_words = logits.shape[0], bitmask.shape[1]
        mask = self._stage(num_rows, num_words)
        staged = mask.numpy()
        if len(rows) == num_rows and rows == list(range(num_rows)):
            np.copyto(staged, bitmask[:num_rows])
        else:  # a mixed batch: the free rows allow everything, so the kernel needs no row indices
            staged.fill(-1)
            staged[rows] = bitmask[: len(rows)]
        if self.device.type != "cpu":
            k = self._turn
            mask = mask.to(self.device, non_blocking=True)
            event = self._copied[k] = self._copied[k] or torch.cuda.Event()
            event.record()
            self._turn = 1 - k
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(logits.shape[-1], num_words * 32))

    def _stage(self, num_rows: int, num_words: int) -> torch.Tensor:
        """The first ``num_rows`` rows of the next staging buffer (grown if need be), once its
        last copy is done."""
        k = self._turn
        buffer, copied = self._staging[k], self._copied[k]
        if copied is not None:
            copied.synchronize()  # its copy of the step before last: long done
        if buffer is None or buffer.shape[0] < num_rows or buffer.shape[1] != num_words:
            buffer = self._staging[k] = torch.empty((max(num_rows, 64), num_words), dtype=torch.int32,
                                                    pin_memory=self.device.type != "cpu")
        return buffer[:num_rows]


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor | list[int], bitmask: np.ndarray) -> None:
    """Set ``logits[rows[j], t] = -inf`` wherever bit t of ``bitmask[j]`` is clear, in place (a
    one-off ``BitmaskApplier``: a runner keeps its own, whose pinned buffers are reused)."""
    rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
    BitmaskApplier(logits.device).apply(logits, rows, bitmask)
