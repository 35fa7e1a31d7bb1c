"""The proposer interface: where speculative decoding's draft tokens come from.

The runner calls ``propose`` once per step, after the step's tokens are known on the host, with
every request that got tokens; the drafts it returns go back to the scheduler in
``ModelRunnerOutput.draft_token_ids`` and come back as ``scheduled_spec_decode_tokens`` when the
scheduler fits them into a later step, where the runner verifies them (rejection_sampler.py).
Drafts are deterministic (a point mass, as in vLLM V1): verification then needs only the target's
tokens. Without ``speculative_config`` no proposer exists (``ModelRunner.proposer is None``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(slots=True)
class ProposeInput:
    """One request after this step: ``token_ids`` is its prompt then every accepted output token
    (a read-only view of the runner's row; valid until the next step)."""

    req_id: str
    token_ids: np.ndarray  # int64 [num_tokens]
    num_prompt_tokens: int


class Proposer(Protocol):
    """Drafts up to k next tokens per request (k is the proposer's own setting)."""

    def propose(self, requests: list[ProposeInput]) -> dict[str, list[int]]:
        """req_id -> draft token ids for the next step (requests without drafts may be left out)."""
        ...

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """Forget these requests (finished, aborted or preempted): free whatever they hold."""
        ...
