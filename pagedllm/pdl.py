"""Programmatic dependent launch (PDL) for the Triton kernels of the decode path (Hopper and later).

A kernel launched with PDL may be placed on the GPU before the kernel ahead of it on the stream has
finished: once every program of the earlier kernel has passed its ``launch_dependents`` point (or
exited), the later kernel's programs take the SMs the earlier one frees and block in
``griddepcontrol.wait`` until it has completed and its writes are visible. In a CUDA graph the
launch becomes a programmatic edge. What it saves is the launch latency between two dependent
kernels of a decode step (a batch-1 step of an 8B model is a chain of a few hundred of them).

Invariant every PDL kernel keeps (``triton_pdl.py``):
- every program calls ``wait_for_inputs`` before it reads anything an earlier kernel of the forward
  wrote and before it writes anything, including programs that exit early; so "kernel N has
  completed" implies "kernel N-1 has completed", and by induction a kernel that starts early can
  only overlap the one kernel ahead of it;
- before the wait a program reads only tensors no kernel of the forward writes: weights, the cos/sin
  caches, and the step's metadata (positions, slot mapping, sequence lengths, query offsets, block
  tables, launch order), all written before the forward's first kernel ran;
- ``allow_dependents`` comes after the program's main loop, just before its stores, so the next
  kernel's programs take SMs only as this kernel's last wave drains (placed at the start instead, they
  would occupy SMs for the whole kernel and slow it; benchmarks/results/h200-pdl-thin-gemm-*.json);
  kernels without a loop (one short wave: RMSNorm, RoPE, SiLU-and-mul, the split-KV reduce) call it
  right after the wait.

Kernels without PDL (cuBLAS, torch's) are unaffected: a kernel launched without the attribute waits
for the full completion of the one before it, and a PDL kernel after one of them starts when it
completes.

Where it is used: the captured CUDA graph of a ``MAX_TOKENS``-request decode (batch 1), where every
projection is a Triton GEMV and the whole layer is a chain of PDL kernels (figures in
benchmarks/results/h200-pdl-batch1-*.json). Where cuBLAS GEMMs sit between the Triton kernels
(batch 2 and up) it gains nothing, so it is off there (``for_graph``). Eager forwards never use it:
its gain is in the replay of a captured graph, where launches cost no host time. Starting DRAM reads
before the wait (an L2 prefetch of the first weight chunk and of the split's K/V rows) made the
batch-1 step slower: not done.

This module is the host side (no Triton import: the runner uses it on every machine); the device
side, ``wait_for_inputs`` and ``allow_dependents``, is ``pagedllm/triton_pdl.py``.

``launch_kwargs(device)`` gives the launch arguments (``USE_PDL`` for the kernel and Triton's
``launch_pdl``): PDL is on for CUDA devices of compute capability >= 9 with a Triton that has
``gdc_wait`` (3.3+), inside ``pdl(True)`` (``for_graph``); off elsewhere. Without PDL both calls
compile away and the kernel is what it was.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from pagedllm import envs

MAX_TOKENS = 1


class _Switch:
    enabled = False  # launches use PDL only inside ``pdl(True)`` / ``for_graph``


@contextlib.contextmanager
def pdl(enabled: bool) -> Iterator[None]:
    """Turn PDL on or off for launches inside the block (restored on exit)."""
    old, _Switch.enabled = _Switch.enabled, enabled
    try:
        yield
    finally:
        _Switch.enabled = old


def for_graph(num_tokens: int, allowed: bool = True) -> contextlib.AbstractContextManager:
    """PDL on while capturing (and warming up) the CUDA graph of a ``num_tokens``-token decode where
    it pays (``num_tokens <= MAX_TOKENS``) and the engine allows it (``KernelConfig.pdl``, from
    ``PAGEDLLM_PDL``); off otherwise."""
    return pdl(allowed and num_tokens <= MAX_TOKENS)


def _triton_has_gdc() -> bool:
    try:
        import triton.language as tl

        return hasattr(tl.extra.cuda, "gdc_wait")
    except (ImportError, AttributeError):
        return False


@functools.lru_cache(maxsize=16)
def _supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and _triton_has_gdc()


def pdl_enabled(device: torch.device) -> bool:
    """Whether Triton kernels launched on ``device`` now use PDL."""
    if not _Switch.enabled or device.type != "cuda" or envs.TRITON_INTERPRET:
        return False
    return _supports_pdl(device.index if device.index is not None else torch.cuda.current_device())


def launch_kwargs(device: torch.device) -> dict[str, bool]:
    """Launch arguments for a kernel with a ``USE_PDL`` constexpr: ``{"USE_PDL": True, "launch_pdl":
    True}`` where PDL is on, else ``{"USE_PDL": False}`` (no launcher option, for older Tritons)."""
    if pdl_enabled(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}
