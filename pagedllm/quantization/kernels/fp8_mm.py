"""``y = (x * x_scale) (W * w_scale)^T (+ b)`` for FP8 weights and per-token FP8 activation codes at
tens of rows (a batched decode step), on the FP8 tensor cores with the operands swapped:
``y^T = W x^T``.

At 33-128 rows a linear layer is still a read of W (8B model at 64 rows: 128 multiply-adds per
weight byte, below the H100's ridge), but cuBLASLt picks tiles made for large M (its FP8 kernel
read 1.3-2.2 TB/s of weights at 64 rows on the 8B shapes). Here a program owns ``BLOCK_N`` weight
rows (the MMA's M side: one warpgroup's ``wgmma`` takes 64) and ``BLOCK_M`` activation rows (the
MMA's N side), streams its ``[BLOCK_N, BLOCK_K]`` chunks of W with ``num_stages`` loads in flight,
and multiplies each by the activations' chunk transposed (e4m3 x e4m3, float32 sums); the sums are
scaled by ``x_scale[m] * w_scale[n]`` once. The activation codes come from the op before the
projection (``fp8_act_quant``: fused with the norm or SiLU-and-mul, or alone).

Loads: with ``tma`` the Hopper tensor-memory accelerator (host-made descriptors of W and x,
out-of-bounds tiles zero-filled; needs 16-byte aligned rows), else pointer loads pipelined by
Triton (cp.async). K is not split: the H100 sweep (``benchmarks/gpu/fp8_decode_bench.py
--mm-sweep``) measured every split-K launch (partials + a sum kernel) slower than one pass with 6
chunks in flight, even where 64 row blocks leave half the SMs idle.

Launch sizes are a function of the shape (``mm_config``), never timed at call time (CUDA-graph
capturable; the only allocation is the output). Requirements (``fits``): ``x`` ``[M, K]``
float8_e4m3fn with contiguous rows and ``[M, 1]`` float32 scales, a contiguous ``[N, K]``
float8_e4m3fn weight and ``[N]`` scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_mm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   TMA: tl.constexpr):
    """Output rows ``rm`` x columns ``rn`` (module doc), accumulated as ``[BLOCK_N, BLOCK_M]`` (weight
    rows first) in float32. With ``TMA`` ``x_ptr`` and ``w_ptr`` are tensor descriptors."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = rn < N
    m_mask = rm < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    # Hopper's FP8 MMA accumulates in reduced precision; promoting into fp32 once per K block keeps
    # long rows (down_proj, K=14336) within 1e-2 of the reference (1.25e-2 without it, on an H100).
    if TMA:
        for k0 in range(0, K, BLOCK_K):
            acc = tl.dot(w_ptr.load([pid_n * BLOCK_N, k0]), tl.trans(x_ptr.load([pid_m * BLOCK_M, k0])), acc,
                         max_num_imprecise_acc=BLOCK_K)
    else:
        rk = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
        x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + rk) < K
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=BLOCK_K)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    y = acc * tl.load(ws_ptr + rn, mask=n_mask, other=0.0)[:, None]
    y = y * tl.load(xs_ptr + rm, mask=m_mask, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], y.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & m_mask[None, :])


Config = tuple[int, int, int, int, int, bool]


def mm_config(m: int, n: int, k: int) -> Config:
    """``(block_m, block_n, block_k, num_warps, num_stages, tma)`` for ``m`` rows and an ``[n, k]``
    weight, the fastest of the H100 sweep at 64 rows on the 8B shapes: up to 64 rows in one block
    (each weight chunk read once per 64 rows), 64 weight rows x 128 columns a chunk (one
    warpgroup), six chunks in flight, TMA loads where the rows are 16-byte aligned."""
    block_m = max(16, triton.next_power_of_2(min(m, 64)))
    return block_m, 64, min(128, max(16, triton.next_power_of_2(k))), 4, 6, k % 16 == 0


def fits(x: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> bool:
    """Whether the kernel takes ``x`` (codes, ``x_scale`` ``[M, 1]``) times ``Wq^T`` (module doc)."""
    return (x.dim() == 2 and x.stride(-1) == 1 and x.dtype == torch.float8_e4m3fn
            and x_scale.numel() == x.shape[0] and x_scale.is_contiguous()
            and wq.dim() == 2 and wq.is_contiguous() and wq.dtype == torch.float8_e4m3fn
            and x.shape[1] == wq.shape[1] and w_scale.numel() == wq.shape[0] and w_scale.is_contiguous())


def _tma_ready(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0


def fp8_mm(x: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
           bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
           config: Config | None = None) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype``: ``(x * x_scale) @ (Wq * w_scale[:, None])^T (+ bias)``; ``config``
    as ``mm_config`` returns (TMA falls back to pointer loads where a row is not 16-byte aligned).
    Precondition: ``fits``."""
    m, k = x.shape
    n = wq.shape[0]
    block_m, block_n, block_k, num_warps, num_stages, tma = config or mm_config(m, n, k)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    x_arg, w_arg = x, wq
    if tma and _tma_ready(x) and _tma_ready(wq):
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_arg = TensorDescriptor.from_tensor(x, [block_m, block_k])
        w_arg = TensorDescriptor.from_tensor(wq, [block_n, block_k])
    else:
        tma = False
    _fp8_mm_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x_arg, x_scale, w_arg, w_scale, bias if bias is not None else w_scale, out, m, n, k, x.stride(0),
        wq.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        TMA=tma, num_warps=num_warps, num_stages=num_stages)
    return out
