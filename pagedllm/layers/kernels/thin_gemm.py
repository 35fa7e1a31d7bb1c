"""``y = x W^T (+ b)`` for a few dozen to a few hundred rows (decode at batch 8..256): a Triton GEMM
tiled for reading W once at full bandwidth.

At these M a projection is still a read of W (Llama-8B's at M=64: 64 FLOPs per weight byte, a
third of what an H200 can do per byte), yet cuBLAS reaches only 2.9-3.3 TB/s of the 4.2-4.4 that
a weight-streaming kernel reaches (benchmarks/kernels/bench_thin_gemm.py). Here the grid is
``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K)``: each program multiplies a ``[BLOCK_M, K / SPLIT_K]``
slice of x by a ``[BLOCK_N, K / SPLIT_K]`` slice of W with ``tl.dot`` (tensor cores, float32
accumulation), streaming both in ``BLOCK_K`` chunks through ``num_stages`` pipelined loads. Splitting
K gives narrow outputs (N = 1024..4096) enough programs to fill the GPU; the split partials (float32,
``[SPLIT_K, M, N]``) are summed, with the bias, by a second small kernel.

Requires ``K % (BLOCK_K * SPLIT_K) == 0`` (true of every model shape; ``pick_config`` only returns
such configs, and ``None`` where none fits: the caller keeps F.linear). Both kernels take part in
programmatic dependent launch (``pagedllm/pdl.py``).

Cost: N*K weight elements read once; x read ``cdiv(N, BLOCK_N)`` times (from L2); with a split,
``SPLIT_K * M * N`` float32 partials written and read once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.pdl import launch_kwargs, wait_for_inputs


@triton.jit
def _thin_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, M, N, stride_xm, stride_wn, stride_om,
                      NUM_K_BLOCKS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_start = tl.program_id(2) * (NUM_K_BLOCKS * BLOCK_K)  # this program's slice of K
    rk = k_start + tl.arange(0, BLOCK_K)
    n_mask = rn < N
    m_mask = rm < M
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    wait_for_inputs(USE_PDL)
    for _ in range(NUM_K_BLOCKS):
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        part = (tl.program_id(2) * M + rm).to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(part_ptr + part, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, b_ptr, out_ptr, M, N, stride_om, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """``out[m, n] = sum_s part[s, m, n] (+ b[n])``, rounded to the output dtype once."""
    m = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_mask = rn < N
    wait_for_inputs(USE_PDL)
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + m) * N + rn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@dataclass(frozen=True)
class ThinGemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@functools.lru_cache(maxsize=16)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_config(m: int, n: int, k: int, num_sms: int = 132) -> ThinGemmConfig | None:
    """The launch configuration for an ``[m, k] x [n, k]^T`` product, or None where none fits K."""
    block_m = min(max(16, triton.next_power_of_2(m)), 64)
    block_k = 128 if k % 128 == 0 else 64
    if k % block_k:
        return None
    block_n = 64
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split_k = 1
    while tiles * split_k < num_sms and k % (block_k * split_k * 2) == 0 and split_k < 8:
        split_k *= 2
    return ThinGemmConfig(block_m, block_n, block_k, split_k)


def thin_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: ThinGemmConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2-D ``x`` (unit column stride) and a contiguous ``weight``
    ``[N, K]`` of x's dtype; ``config`` defaults to ``pick_config`` (which must not be None).
    Returns a new ``[M, N]`` tensor in ``x``'s dtype (or ``out``)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1 and weight.dtype == x.dtype
    if config is None:
        sms = _num_sms(x.device.index if x.device.index is not None else torch.cuda.current_device()) \
            if x.device.type == "cuda" else 132
        config = pick_config(m, n, k, sms)
        assert config is not None, f"thin_linear: K={k} fits no tile"
    c = config
    assert k % (c.block_k * c.split_k) == 0, f"K={k} must be a multiple of BLOCK_K * SPLIT_K = {c.block_k * c.split_k}"
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    pdl = launch_kwargs(x.device)
    split = c.split_k > 1
    part = torch.empty((c.split_k, m, n), dtype=torch.float32, device=x.device) if split else out
    b = bias if bias is not None else weight
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(n, c.block_n), triton.cdiv(m, c.block_m), c.split_k)
    _thin_gemm_kernel[grid](x, weight, b, out, part, m, n, x.stride(0), weight.stride(0), out.stride(0),
                            NUM_K_BLOCKS=k // (c.split_k * c.block_k), HAS_BIAS=bias is not None and not split, SPLIT=split,
                            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, DOT_PRECISION=precision,
                            num_warps=c.num_warps, num_stages=c.num_stages, **pdl)
    if split:
        block = min(1024, triton.next_power_of_2(n))
        _sum_splits_kernel[(m, triton.cdiv(n, block))](part, b, out, m, n, out.stride(0), SPLIT_K=c.split_k,
                                                        HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **pdl)
    return out
