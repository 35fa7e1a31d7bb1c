"""Batched LoRA over a mixed batch: each token runs its own adapter's delta, grouped by adapter.

The punica / S-LoRA "SGMV" design: a step's tokens are grouped by their adapter slot
(``LoRABatchMapping``), and the delta ``y += (x @ A[s]^T) @ B[s]^T`` is two grouped products over the
stacked per-slot matrices, ``shrink`` (``[T, K] -> [T, R]``, R the small rank) and ``expand``
(``[T, R] -> [T, N]``, added to the base output). Tokens without an adapter (slot -1) are in no
group and cost nothing. On the CPU each group is one ``index_select`` + two matmuls + one
``index_add_``; on CUDA two Triton launches per layer (``kernels.py``; a merged qkv or gate_up
layer included), whatever the number of adapters. The scaling is folded into B when an adapter
is loaded.
"""

from __future__ import annotations

import torch

from pagedllm.lora.mapping import LoRABatchMapping


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             mapping: LoRABatchMapping, slice_starts: tuple[int, ...] = (0,), slice_rank: int | None = None,
             shrunk: torch.Tensor | None = None) -> torch.Tensor:
    """``y[t] += (x[t] @ lora_a[s]^T) @ lora_b[s]^T`` for every token ``t`` of slot ``s``, in place.

    ``x [T, K]``, ``y [T, N]``, ``lora_a [slots, R, K]``, ``lora_b [slots, N, R]`` (scaling folded).
    A merged layer's B is block-diagonal: output rows from ``slice_starts[i]`` on are nonzero only
    in columns ``i * slice_rank ...`` (a hint the Triton expand uses to skip the zero blocks).
    ``shrunk``: a zeroed float32 ``[T, R]`` for the Triton shrink (None: it allocates one).
    CUDA: the Triton shrink / expand; elsewhere ``add_lora_torch``. Returns ``y``."""
    if y.is_cuda:
        from pagedllm.lora import kernels

        return kernels.add_lora_triton(y, x, lora_a, lora_b, mapping, slice_starts, slice_rank, shrunk)
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
