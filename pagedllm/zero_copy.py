"""Zero-copy transfers: kernels that read and write pinned host memory directly, instead of a
copy-engine memcpy, for the few KB a decode step sends to the GPU and gets back.

Pinned memory is mapped into the GPU's address space (CUDA unified addressing; Triton's launcher
asks the driver for a pointer's device address), so a kernel can load from it and store to it over
PCIe. Why bother: a stream-ordered memcpy of a decode step's few inputs is short on the copy
engine, but the handoffs between copy engine and SMs leave the GPU idle before it and before the
kernel that waits for it, and the device->host copy of the sampled ids starts well after the
sampler ends (``benchmarks/gpu/timeline_decode.py`` shows the gaps): a few percent of a small
model's batch-1 step. A kernel on the compute queue costs only its own run time, no handoff.

Users: ``DeviceInputs.copy_to_device`` (a step's staged inputs, up to ``MAX_FETCH_BYTES``; prefill
steps' larger inputs take the copy engine) and the fused sampler, whose last kernel also stores the
token ids into a pinned buffer (no device->host copy). Ordering is the stream's: the host writes a
staging buffer before it enqueues the kernel that reads it, and reads a result buffer only after an
event recorded behind the kernel that wrote it has completed (CUDA's rule for mapped memory).

``available()`` probes once per device that a kernel can read and write torch's pinned memory;
without Triton, CUDA or mapped pinned memory the callers keep their plain copies.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

logger = logging.getLogger("pagedllm")

HAS_TRITON = importlib.util.find_spec("triton") is not None
MAX_FETCH_BYTES = 64 * 1024  # larger transfers (prefill inputs) go through the copy engine
_BLOCK = 1024  # int64 words per program

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_words_kernel(src_ptr, dst_ptr, num_words, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < num_words
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def copy_words(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst[:] = src`` for two contiguous int64 vectors of one length, either of them pinned host
    memory and the other on the current CUDA device: one kernel on the current stream, no wait."""
    assert src.dtype == dst.dtype == torch.int64 and src.numel() == dst.numel()
    n = src.numel()
    if n:
        _copy_words_kernel[(triton.cdiv(n, _BLOCK),)](src, dst, n, BLOCK=_BLOCK, num_warps=4)


def available(device: torch.device) -> bool:
    """Whether kernels on ``device`` can read and write torch's pinned host memory (probed once)."""
    if device.type != "cuda" or not HAS_TRITON:
        return False
    return _probe(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=8)
def _probe(device_index: int) -> bool:
    try:
        with torch.cuda.device(device_index):
            host_in = torch.arange(3 * _BLOCK, dtype=torch.int64).pin_memory()
            dev = torch.full_like(host_in, -1, device=f"cuda:{device_index}")
            host_out = torch.zeros_like(host_in).pin_memory()
            copy_words(host_in, dev)
            dev.mul_(3)
            copy_words(dev, host_out)
            torch.cuda.synchronize(device_index)
            ok = torch.equal(host_out, host_in * 3)
    except Exception as exc:  # a platform without mapped pinned memory: plain copies then
        logger.info("zero-copy transfers unavailable on cuda:%d (%s); using copy-engine copies", device_index, exc)
        return False
    if not ok:
        logger.info("zero-copy probe on cuda:%d read wrong values; using copy-engine copies", device_index)
    return ok
