"""LoRABatchMapping: one step's tokens grouped by their adapter slot (what the batched LoRA ops
of ``punica.py`` and ``kernels.py`` read)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LoRABatchMapping:
    """One step's tokens grouped by adapter slot, built once per step on the host.

    Invariant: ``sorted_token_ids[starts[g]:starts[g+1]]`` are the (increasing) indices of the
    tokens that run slot ``active_slots[g]``; every token with a slot is in exactly one group.
    ``max_group_size`` is the largest group (the Triton grid's row extent). Device tensors:
    ``sorted_token_ids`` (int64), ``starts_dev`` and ``active_slots_dev`` (int32); host lists for
    the CPU loop. Cost: O(T log T) numpy on the host and one small host->device copy."""

    sorted_token_ids: torch.Tensor
    starts: list[int]
    active_slots: list[int]
    starts_dev: torch.Tensor
    active_slots_dev: torch.Tensor
    max_group_size: int
    num_tokens: int


def build_mapping(token_slots: np.ndarray, device: torch.device) -> LoRABatchMapping | None:
    """The mapping of a step whose token ``i`` runs slot ``token_slots[i]`` (-1: no adapter); None
    when no token has one (the layers then run without a delta)."""
    with_lora = np.nonzero(token_slots >= 0)[0]
    if not len(with_lora):
        return None
    order = with_lora[np.argsort(token_slots[with_lora], kind="stable")]
    slots, counts = np.unique(token_slots[order], return_counts=True)
    starts = np.zeros(len(slots) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    packed = torch.from_numpy(np.concatenate([order, starts, slots]).astype(np.int64)).to(device, non_blocking=True)
    n, g = len(order), len(slots)
    return LoRABatchMapping(
        sorted_token_ids=packed[:n], starts=starts.tolist(), active_slots=slots.tolist(),
        starts_dev=packed[n : n + g + 1].to(torch.int32), active_slots_dev=packed[n + g + 1 :].to(torch.int32),
        max_group_size=int(counts.max()), num_tokens=len(token_slots),
    )
