"""``y = x W^T`` for a handful of rows (decode at batch 1..4): a weight-streaming GEMV in Triton.

At M <= 4 a linear layer is a pure read of W; cuBLAS picks GEMM tiles for these shapes that reach
only a fraction of the copy bandwidth (benchmarks/kernels/bench_skinny_gemm.py measures it; where
the GEMV wins is the device's ``layers/tuning.py`` row). Here each program owns
``BLOCK_N`` output columns and streams their ``[BLOCK_N, K]`` slice of W once, in ``BLOCK_K``
chunks, for all M rows at once (M, 1..4, is a compile-time constant), accumulating in fp32.
Grid ``cdiv(N, BLOCK_N)``; ``BLOCK_N`` is chosen so that there are >= ~4 programs per SM.

With PDL (``pagedllm/pdl.py``) a program waits for the kernel that wrote x before its loop and lets
the next kernel launch after it. The first weight chunk's reads are not started before the wait:
into registers or as an L2 prefetch, that made the batch-1 step slower (benchmarks/results/).

Cost: N*K weight elements read once, M*K input elements per program (L2 hits), M*N written.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedllm.layers.tuning import for_device
from pagedllm.pdl import launch_kwargs
from pagedllm.triton_pdl import allow_dependents, wait_for_inputs

MAX_ROWS = 4


@triton.jit
def _column_block(w_ptr, N, stride_wn, BLOCK_N: tl.constexpr):
    """This program's ``BLOCK_N`` output columns: ``(rn, n_mask, pointers to their weight rows)``."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    return rn, n_mask, w_ptr + rn.to(tl.int64)[:, None] * stride_wn


@triton.jit
def _weight_chunk(w_rows, n_mask, k_start, K, BLOCK_K: tl.constexpr):
    """Columns ``[k_start, k_start + BLOCK_K)`` of the block's weight rows as float32:
    ``(rk, k_mask, w [BLOCK_N, BLOCK_K])``."""
    rk = k_start + tl.arange(0, BLOCK_K)
    k_mask = rk < K
    w = tl.load(w_rows + rk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
    return rk, k_mask, w


@triton.jit
def _store_rows(b_ptr, out_ptr, rn, n_mask, stride_om, acc0, acc1, acc2, acc3, M: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """Add the bias (float32) and store the M accumulated rows, rounded to the output dtype."""
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        acc0 += bias
        acc1 += bias
        acc2 += bias
        acc3 += bias
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + rn, acc0.to(out_dtype), mask=n_mask)
    if M > 1:
        tl.store(out_ptr + stride_om + rn, acc1.to(out_dtype), mask=n_mask)
    if M > 2:
        tl.store(out_ptr + 2 * stride_om + rn, acc2.to(out_dtype), mask=n_mask)
    if M > 3:
        tl.store(out_ptr + 3 * stride_om + rn, acc3.to(out_dtype), mask=n_mask)


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om,
                        M: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_PDL: tl.constexpr):
    rn, n_mask, w_rows = _column_block(w_ptr, N, stride_wn, BLOCK_N)
    wait_for_inputs(USE_PDL)
    acc0 = tl.zeros((BLOCK_N,), tl.float32)
    acc1 = tl.zeros((BLOCK_N,), tl.float32)
    acc2 = tl.zeros((BLOCK_N,), tl.float32)
    acc3 = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk, k_mask, w = _weight_chunk(w_rows, n_mask, k0, K, BLOCK_K)
        x0 = tl.load(x_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
        acc0 += tl.sum(w * x0[None, :], axis=1)
        if M > 1:
            x1 = tl.load(x_ptr + stride_xm + rk, mask=k_mask, other=0.0).to(tl.float32)
            acc1 += tl.sum(w * x1[None, :], axis=1)
        if M > 2:
            x2 = tl.load(x_ptr + 2 * stride_xm + rk, mask=k_mask, other=0.0).to(tl.float32)
            acc2 += tl.sum(w * x2[None, :], axis=1)
        if M > 3:
            x3 = tl.load(x_ptr + 3 * stride_xm + rk, mask=k_mask, other=0.0).to(tl.float32)
            acc3 += tl.sum(w * x3[None, :], axis=1)
    allow_dependents(USE_PDL)
    _store_rows(b_ptr, out_ptr, rn, n_mask, stride_om, acc0, acc1, acc2, acc3, M, HAS_BIAS)


@functools.lru_cache(maxsize=64)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_block_n(n: int, num_sms: int) -> int:
    """The widest power-of-two column block (4..64) that still gives >= 4 programs per SM."""
    block = 64
    while block > 4 and triton.cdiv(n, block) < 4 * num_sms:
        block //= 2
    return block


def launch_config(device: torch.device, n: int, k: int, block_n: int | None = None, block_k: int | None = None,
                  num_warps: int | None = None, norm_prologue: bool = False) -> tuple[int, int, int]:
    """``(block_n, block_k, num_warps)``, each the given value or the default for an ``[n, k]`` weight
    (``norm_prologue``: for ``fused_gemv.rms_norm_linear``). Defaults (the size thresholds are the
    device's ``layers/tuning.py`` row): long rows stream in 1024-element chunks with 8 warps;
    ``block_n`` from ``pick_block_n``; weights from ``gemv_medium_weight_elements``: 8 columns, in
    512-element chunks with 4 warps behind the norm prologue, else in 1024-element chunks with 8
    warps; over ``gemv_large_weight_elements``: 16 columns in 512-element chunks with 4 warps for
    rows up to 4096, else 8 columns in 1024-element chunks with 8 warps. (The fused decode GEMVs of
    ``fused_gemv.py`` use the same defaults.)"""
    tuning = for_device(device)
    if n * k > tuning.gemv_large_weight_elements:
        short_rows = k <= 4096
        large = (16, 512, 4) if short_rows else (8, 1024, 8)
        return block_n or large[0], block_k or large[1], num_warps or large[2]
    if n * k >= tuning.gemv_medium_weight_elements:
        medium = (8, 512, 4) if norm_prologue else (8, 1024, 8)
        return block_n or medium[0], block_k or medium[1], num_warps or medium[2]
    if block_k is None:
        block_k = 1024 if k >= 2048 else 512
    if num_warps is None:
        num_warps = 8 if k >= 2048 else 4
    if block_n is None:
        if device.type == "cuda":
            sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
        else:  # Triton's CPU interpreter (tests): size the grid as for an H200
            sms = 132
        block_n = pick_block_n(n, sms)
    return block_n, block_k, num_warps


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                  num_stages: int = 3) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2-D ``x`` with 1 <= M <= 4 rows and a contiguous ``weight``
    ``[N, K]``. Returns a new ``[M, N]`` tensor in ``x``'s dtype."""
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= MAX_ROWS and weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps = launch_config(x.device, n, k, block_n, block_k, num_warps)
    grid = (triton.cdiv(n, block_n),)
    _skinny_gemm_kernel[grid](x, weight, bias if bias is not None else weight, out, n, k, x.stride(0),
                              weight.stride(0), out.stride(0), M=m, HAS_BIAS=bias is not None,
                              BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
                              **launch_kwargs(x.device))
    return out
