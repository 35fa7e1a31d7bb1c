"""LoRABatchMapping: one step's tokens grouped by their adapter slot (what the batched LoRA ops
of ``punica.py`` and ``kernels.py`` read), for an eager step or for a CUDA graph.

One int64 device tensor holds ``[token ids in group order | group starts | group slots]``, each
region starting on 16 bytes (Triton specializes its kernels on pointer alignment: one variant). An
eager step's mapping has exactly its groups; a graph's mapping (``GraphMapping``) has fixed-size
regions (room for ``max_tokens`` ids and ``max_groups`` groups; unused groups are empty, so their
programs return at once), so that a captured graph reads whatever a later step writes there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LoRABatchMapping:
    """A step's tokens grouped by adapter slot.

    Invariant: ``sorted_token_ids[starts[g]:starts[g+1]]`` are the (increasing) indices of the
    tokens that run slot ``active_slots[g]``; every token with a slot is in exactly one group.
    Device views (int64): ``sorted_token_ids``, ``starts_dev`` (groups + 1), ``active_slots_dev``;
    the Triton grid has ``num_groups`` columns of ``max_group_size`` rows. Host lists ``starts`` and
    ``active_slots`` (the CPU loop) are None in a graph's mapping. Cost: O(T log T) numpy on the
    host and one host->device copy."""

    sorted_token_ids: torch.Tensor
    starts_dev: torch.Tensor
    active_slots_dev: torch.Tensor
    num_groups: int
    max_group_size: int
    starts: list[int] | None = None
    active_slots: list[int] | None = None


def group_tokens(token_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(token ids in group order, group starts, group slots)`` for tokens running slot
    ``token_slots[i]`` (-1: none); None when no token has an adapter."""
    with_lora = np.nonzero(token_slots >= 0)[0]
    if not len(with_lora):
        return None
    order = with_lora[np.argsort(token_slots[with_lora], kind="stable")]
    slots, counts = np.unique(token_slots[order], return_counts=True)
    starts = np.zeros(len(slots) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return order, starts, slots


def build_mapping(token_slots: np.ndarray, device: torch.device) -> LoRABatchMapping | None:
    """The eager mapping of a step (None when no token has an adapter: no delta at all)."""
    groups = group_tokens(token_slots)
    if groups is None:
        return None
    order, starts, slots = groups
    n, g = len(order), len(slots)
    n_pad, g_pad = _even(n), _even(g + 1)
    host = np.zeros(n_pad + g_pad + g, dtype=np.int64)
    host[:n], host[n_pad : n_pad + g + 1], host[n_pad + g_pad :] = order, starts, slots
    packed = torch.from_numpy(host).to(device, non_blocking=True)
    return LoRABatchMapping(sorted_token_ids=packed[:n], starts_dev=packed[n_pad : n_pad + g + 1],
                            active_slots_dev=packed[n_pad + g_pad :], num_groups=g,
                            max_group_size=int(np.diff(starts).max()), starts=starts.tolist(),
                            active_slots=slots.tolist())


def _even(n: int) -> int:
    return n + (n & 1)


class GraphMapping:
    """The fixed device buffer that CUDA graphs with LoRA read (module doc): ``for_size(bs)`` is
    the mapping a graph of ``bs`` tokens is captured with, ``stage(token_slots)`` writes a step's
    groups into the buffer before a replay. Invariant: the buffer always holds a valid grouping
    (empty groups start and end at the number of grouped tokens).

    The staging copy is non-blocking from one of two pinned host sets (on CUDA), so the host
    never waits for the GPU here: with async scheduling it writes step N+1's set while step N's
    copy may still be queued, and each set's copy records an event that the set's next use waits
    on (long done by then: two steps later). The one device buffer is safe: a step's copy is
    queued behind the previous step's graph on the same stream."""

    def __init__(self, max_tokens: int, max_groups: int, device: torch.device) -> None:
        self.max_tokens, self.max_groups = max_tokens, max_groups
        self._starts_at, self._slots_at = _even(max_tokens), _even(max_tokens) + _even(max_groups + 1)
        self.buffer = torch.zeros(self._slots_at + max_groups, dtype=torch.int64, device=device)
        on_cuda = device.type == "cuda"
        self._hosts = [torch.zeros(self.buffer.shape[0], dtype=torch.int64, pin_memory=on_cuda) for _ in range(2)]
        self._copied = [torch.cuda.Event() if on_cuda else None for _ in range(2)]
        self._set = 0

    def for_size(self, num_tokens: int) -> LoRABatchMapping:
        g, starts_at, slots_at = self.max_groups, self._starts_at, self._slots_at
        return LoRABatchMapping(sorted_token_ids=self.buffer[: self.max_tokens],
                                starts_dev=self.buffer[starts_at : starts_at + g + 1],
                                active_slots_dev=self.buffer[slots_at:], num_groups=g, max_group_size=num_tokens)

    def stage(self, token_slots: np.ndarray) -> None:
        """Write the groups of ``token_slots`` (at most ``max_tokens`` tokens, ``max_groups`` slots)."""
        self._set ^= 1
        copied = self._copied[self._set]
        if copied is not None:
            copied.synchronize()  # this set's previous copy (two steps ago) has read it
        groups = group_tokens(token_slots)
        host, g, starts_at, slots_at = self._hosts[self._set].numpy(), self.max_groups, self._starts_at, self._slots_at
        host[:] = 0
        if groups is not None:
            order, starts, slots = groups
            host[: len(order)] = order
            host[starts_at : starts_at + len(starts)] = starts
            host[starts_at + len(starts) : starts_at + g + 1] = len(order)
            host[slots_at : slots_at + len(slots)] = slots
        self.buffer.copy_(self._hosts[self._set], non_blocking=True)
        if copied is not None:
            copied.record()
