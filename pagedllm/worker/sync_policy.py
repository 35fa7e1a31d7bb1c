"""When the CPU must wait for the previous step's sampled tokens before preparing the next step.

With async scheduling step N+1 is prepared while step N runs: a token step N samples is forwarded
to step N+1 on the device (``ModelRunner`` stages the copy), so the host need not know it. The
host must wait for step N first when a row scheduled in step N+1 has a token still in flight and

- its sampling reads its exact past token ids (penalties, bad words): they build host tensors; or
- step N verified drafts for it: how many tokens it accepted is known only on the host; or
- step N+1 carries drafts for it: they are placed after its last accepted token.
"""

from __future__ import annotations

import numpy as np


class StepSyncPolicy:
    """Per-row reasons to wait, kept as boolean arrays by InputBatch row.

    Invariant: ``reads_history[row]`` is set while the row's request reads its token history;
    ``verified[row]`` is set exactly for the rows whose last launched step verified drafts
    (``any_verified`` says whether there are any). Cost of ``must_wait``: two gathers over the
    scheduled rows (numpy, no Python loop per request), one more only when some row has a reason.
    """

    def __init__(self, max_num_reqs: int) -> None:
        self.reads_history = np.zeros(max_num_reqs, dtype=bool)
        self.verified = np.zeros(max_num_reqs, dtype=bool)
        self.any_verified = False

    def add_request(self, row: int, params) -> None:
        """A request took ``row``: note whether its sampling reads its exact past token ids
        (penalties, bad words), not just their count."""
        self.reads_history[row] = bool(
            params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
            or params._bad_words_token_ids
        )

    def must_wait(self, rows: np.ndarray, num_pending: np.ndarray, has_drafts: bool) -> bool:
        """Whether the step scheduling ``rows`` (``has_drafts``: with drafts for some) must first
        wait for the previous step's tokens."""
        if has_drafts:
            return bool(num_pending[rows].any())
        waits = self.reads_history[rows]
        if self.any_verified:
            waits = waits | self.verified[rows]
        return bool(waits.any() and num_pending[rows[waits]].any())

    def launched(self, verified_rows: np.ndarray | None) -> None:
        """A step was launched; ``verified_rows`` are the rows whose drafts it verifies (or None)."""
        if self.any_verified:
            self.verified[:] = False
        self.any_verified = verified_rows is not None and len(verified_rows) > 0
        if self.any_verified:
            self.verified[verified_rows] = True
