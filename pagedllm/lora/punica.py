"""Batched LoRA over a mixed batch: each token runs its own adapter's delta, grouped by adapter.

The punica / S-LoRA "SGMV" design: a step's tokens are grouped by their adapter slot
(``LoRABatchMapping``), and the delta ``y += (x @ A[s]^T) @ B[s]^T`` is two grouped products over the
stacked per-slot matrices, ``shrink`` (``[T, K] -> [T, R]``, R the small rank) and ``expand``
(``[T, R] -> [T, N]``, added to the base output). Tokens without an adapter (slot -1) are in no
group and cost nothing. On the CPU each group is one ``index_select`` + two matmuls + one
``index_add_``; on CUDA two Triton launches per layer (``kernels.py``), whatever the number of
adapters. The scaling is folded into B when an adapter is loaded.
"""

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


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             mapping: LoRABatchMapping) -> torch.Tensor:
    """``y[t] += (x[t] @ lora_a[s]^T) @ lora_b[s]^T`` for every token ``t`` of slot ``s``, in place.

    ``x [T, K]``, ``y [T, N]``, ``lora_a [slots, R, K]``, ``lora_b [slots, N, R]`` (scaling folded).
    CUDA: the Triton shrink / expand; elsewhere ``add_lora_torch``. Returns ``y``."""
    if y.is_cuda:
        from pagedllm.lora import kernels

        return kernels.add_lora_triton(y, x, lora_a, lora_b, mapping)
    return add_lora_torch(y, x, lora_a, lora_b, mapping)


def add_lora_torch(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   mapping: LoRABatchMapping) -> torch.Tensor:
    """The grouped matmuls (the reference of the Triton kernels): gather the adapter tokens' rows in
    group order once, shrink and expand each group's contiguous rows in float32, and add the
    deltas into their rows of ``y`` with one scatter. Ops: 2 per step + 2 per active adapter."""
    ids, starts = mapping.sorted_token_ids, mapping.starts
    rows = x.index_select(0, ids).float()
    delta = torch.empty(len(ids), y.shape[-1], dtype=torch.float32, device=y.device)
    for g, slot in enumerate(mapping.active_slots):
        lo, hi = starts[g], starts[g + 1]
        torch.mm(rows[lo:hi] @ lora_a[slot].float().t(), lora_b[slot].float().t(), out=delta[lo:hi])
    return y.index_add_(0, ids, delta.to(y.dtype))
