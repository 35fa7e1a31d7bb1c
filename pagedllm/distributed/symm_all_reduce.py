"""A one-shot all-reduce over PyTorch's symmetric memory, for the small activations of decode steps.

NCCL's all-reduce of a decode step's activation (a few KiB to a MiB) is bound by its protocol's
latency, paid twice per decoder layer under tensor parallelism. Symmetric memory maps one buffer of
every rank into every other rank's address space (CUDA IPC over NVLink); ``one_shot_all_reduce``
then is one kernel in which each rank reads all peers' buffers and sums them, after a barrier on
signal pads. It runs inside CUDA graphs. NVLink multicast is not used (the one-shot kernel reads
peers point to point; multimem operations are never called).

Invariant: ``buffer`` is one symmetric allocation of ``max_numel`` elements of ``dtype``,
rendezvoused by every rank of ``group``; like any collective, every rank makes the same calls in
the same order. Cost: one copy of the input into the buffer plus one kernel that reads
``world_size`` copies of it; the memory of one buffer per rank.
"""

from __future__ import annotations

from typing import Any

import torch


class SymmMemAllReduce:
    def __init__(self, group: Any, device: torch.device, max_bytes: int, dtype: torch.dtype) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required before torch 2.9, a no-op after
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, group)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.max_numel and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group, written into ``x`` (as the NCCL path does)."""
        staged = self.buffer[: x.numel()]
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, x.view(-1))
        return x


def make_symm_all_reduce(group: Any, device: torch.device, max_bytes: int,
                         dtype: torch.dtype = torch.bfloat16) -> SymmMemAllReduce | None:
    """A ``SymmMemAllReduce`` for ``group`` on ``device``, or None where symmetric memory is not
    available (not CUDA, or this PyTorch build or these GPUs lack it): the caller keeps NCCL."""
    if device.type != "cuda":
        return None
    try:
        return SymmMemAllReduce(group, device, max_bytes, dtype)
    except (RuntimeError, ImportError, AttributeError) as exc:
        import logging

        logging.getLogger(__name__).warning("symmetric-memory all-reduce unavailable (%s); using NCCL", exc)
        return None
