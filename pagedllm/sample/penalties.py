"""Repetition, presence and frequency penalties, vectorised over the rows that use them.

vLLM semantics: the repetition penalty divides a positive logit and multiplies a non-positive one
for every token seen in the prompt *or* the output; presence subtracts ``presence`` once per token
seen in the output; frequency subtracts ``frequency * count`` per output occurrence. Counts are a
[Bp, V] tensor built each step with one scatter_add from the runner's token ids (only the rows
that use a penalty, and only when one does). Cost per step: O(Bp * V + Bp * tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.sample.history import TokenHistory
from pagedllm.sampling_params import SamplingParams


def uses_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


@dataclass
class Penalties:
    """A logits processor: ``rows`` (None = every row) get their penalties applied in place."""

    rows: torch.Tensor | None  # int64 [Bp]
    output_counts: torch.Tensor  # float32 [Bp, V]: occurrences of each token in the output
    prompt_mask: torch.Tensor | None  # bool [Bp, V]: token occurs in the prompt; None = no repetition
    presence: torch.Tensor  # float32 [Bp, 1]
    frequency: torch.Tensor  # float32 [Bp, 1]
    repetition: torch.Tensor | None  # float32 [Bp, 1]; None when every row has 1.0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits if self.rows is None else logits[self.rows]
        seen_in_output = self.output_counts > 0
        if self.repetition is not None:
            seen = seen_in_output | self.prompt_mask
            factor = torch.where(seen, self.repetition, 1.0)
            x = torch.where(x > 0, x / factor, x * factor)
        x = x - self.frequency * self.output_counts - self.presence * seen_in_output
        if self.rows is None:
            return x
        logits[self.rows] = x
        return logits


def build_penalties(
    params: list[SamplingParams], history: TokenHistory, vocab_size: int, device: torch.device
) -> Penalties | None:
    """The Penalties processor for this step, or None when no row uses a penalty."""
    sel = [i for i, p in enumerate(params) if uses_penalties(p)]
    if not sel:
        return None
    chosen = [params[i] for i in sel]
    with_prompt = any(p.repetition_penalty != 1.0 for p in chosen)
    prompt_ids, output_ids = history.padded_ids(np.asarray(sel, dtype=np.int64), vocab_size, with_prompt)
    counts = token_counts(torch.from_numpy(output_ids).to(device), vocab_size)
    prompt_mask = token_mask(torch.from_numpy(prompt_ids).to(device), vocab_size) if with_prompt else None

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    return Penalties(
        rows=None if len(sel) == len(params) else torch.tensor(sel, dtype=torch.int64, device=device),
        output_counts=counts,
        prompt_mask=prompt_mask,
        presence=column([p.presence_penalty for p in chosen]),
        frequency=column([p.frequency_penalty for p in chosen]),
        repetition=column([p.repetition_penalty for p in chosen]) if with_prompt else None,
    )


def token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [B, V] counts of each id per row; ids equal to ``vocab_size`` are padding."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=ids.device))
    return counts[:, :vocab_size]


def token_mask(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [B, V]: whether each id occurs in the row; ids equal to ``vocab_size`` are padding."""
    mask = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(1, ids, True)
    return mask[:, :vocab_size]
