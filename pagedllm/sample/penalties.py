"""Repetition, presence and frequency penalties, touching only the tokens each row has seen.

vLLM semantics: the repetition penalty divides a positive logit and multiplies a non-positive one
for every token seen in the prompt *or* the output; presence subtracts ``presence`` once per token
seen in the output; frequency subtracts ``frequency * count`` per output occurrence.

Only seen tokens change, so the processor gathers the logits at each row's token ids ([Bp, W],
W = the longest history), adjusts them and scatters them back; a token seen several times is
written several times with the same value. The output counts come from one scatter_add into a
zeroed [Bp, V] buffer (a memset, no compute) gathered back at the ids. Cost per step: O(Bp * W)
plus that memset, built only for the rows that use a penalty and only when one does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.sample.history import TokenHistory
from pagedllm.sample.transfer import host_to_device, numpy_to_device
from pagedllm.sampling_params import SamplingParams


def uses_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


@dataclass
class Penalties:
    """A logits processor. Row ``rows[i]`` has seen tokens ``ids[i]`` (padding repeats a real one)."""

    rows: torch.Tensor  # int64 [Bp, 1]
    ids: torch.Tensor  # int64 [Bp, W]
    counts: torch.Tensor  # float32 [Bp, W]: occurrences of ids[i, j] in row i's output
    presence: torch.Tensor  # float32 [Bp, 1]
    frequency: torch.Tensor  # float32 [Bp, 1]
    repetition: torch.Tensor  # float32 [Bp, 1] (1.0 = off)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits[self.rows, self.ids]
        x = torch.where(x > 0, x / self.repetition, x * self.repetition)
        x = x - self.frequency * self.counts - self.presence * (self.counts > 0)
        logits[self.rows, self.ids] = x
        return logits


def build_penalties(
    params: list[SamplingParams], history: TokenHistory, vocab_size: int, device: torch.device
) -> Penalties | None:
    """The Penalties processor for this step, or None when no row uses a penalty. The prompt's
    tokens are included only when some row uses the repetition penalty (the others need none)."""
    sel = [i for i, p in enumerate(params) if uses_penalties(p)]
    if not sel:
        return None
    chosen = [params[i] for i in sel]
    with_prompt = any(p.repetition_penalty != 1.0 for p in chosen)
    ids, is_output, valid = history.window(np.asarray(sel, dtype=np.int64), with_prompt)
    first_valid = ids[np.arange(len(sel)), valid.argmax(axis=1)] * valid.any(axis=1)
    ids_t = numpy_to_device(np.where(valid, ids, first_valid[:, None]), device)
    counts = torch.zeros(len(sel), vocab_size, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids_t, numpy_to_device(is_output.astype(np.float32), device))

    def column(values: list[float]) -> torch.Tensor:
        return host_to_device(values, torch.float32, device).unsqueeze(1)

    return Penalties(
        rows=host_to_device(sel, torch.int64, device).unsqueeze(1),
        ids=ids_t,
        counts=counts.gather(1, ids_t),
        presence=column([p.presence_penalty for p in chosen]),
        frequency=column([p.frequency_penalty for p in chosen]),
        repetition=column([p.repetition_penalty for p in chosen]),
    )
