"""Programmatic dependent launch (PDL) for the Triton kernels of the decode path (Hopper and later).

A kernel launched with PDL may start while the kernel before it on the stream is still finishing:
its programs are placed on the SMs the earlier kernel frees, compute their addresses (and, for the
weight-streaming GEMVs, issue their first weight loads) and then block in ``griddepcontrol.wait``
until the earlier kernel has completed and its writes are visible. Inside a CUDA graph the launch
becomes a programmatic edge, so the gap between two dependent kernels of a decode step -- launch
latency, then the last wave draining while most SMs idle -- shrinks to the wait.

Invariant every PDL kernel keeps (``wait_for_inputs`` is where): every program executes the wait
before it reads anything an earlier kernel wrote and before it writes anything -- including
programs that return early -- so "kernel N has completed" still implies "kernel N-1 has completed"
and the chain stays ordered. What a program does before the wait reads only launch arguments and
tensors no kernel writes (weights). Right after the wait a program allows the next kernel to launch
(``griddepcontrol.launch_dependents``), so at most one kernel runs ahead.

``launch_kwargs(device)`` gives the two launch arguments (``USE_PDL`` for the kernel, ``launch_pdl``
for Triton's launcher): PDL on for CUDA devices of compute capability >= 9 unless ``PAGEDLLM_PDL=0``;
``pdl(False)`` turns it off inside a block (before/after benchmarks and tests). Without PDL the wait
compiles away and the kernel is what it was.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch
import triton
import triton.language as tl


class _Switch:
    enabled = os.environ.get("PAGEDLLM_PDL", "1").lower() not in ("0", "false", "no", "off")


@contextlib.contextmanager
def pdl(enabled: bool) -> Iterator[None]:
    """Turn PDL on or off for launches inside the block (restored on exit)."""
    old, _Switch.enabled = _Switch.enabled, enabled
    try:
        yield
    finally:
        _Switch.enabled = old


@functools.lru_cache(maxsize=16)
def _supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and hasattr(tl.extra.cuda, "gdc_wait")


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` now use PDL."""
    if not _Switch.enabled or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _supports_pdl(device.index if device.index is not None else torch.cuda.current_device())


def launch_kwargs(device: torch.device) -> dict[str, bool]:
    """``{"USE_PDL": ..., "launch_pdl": ...}`` for a launch of a kernel that calls ``wait_for_inputs``."""
    on = pdl_enabled(device)
    return {"USE_PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_inputs(USE_PDL: tl.constexpr):
    """Block until the previous kernel on the stream has completed (its writes visible), then let the
    next kernel launch. A no-op without PDL. Call it in every program, before the first read of an
    earlier kernel's output and before the first store."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
