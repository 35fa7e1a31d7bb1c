"""``y = x W^T (+ b)`` for FP8 weights at tens of rows (a batched decode step), on the tensor cores
with the operands swapped: ``y^T = W x^T``.

At 33-128 rows a linear layer is still a read of W (8B model at 64 rows: 128 multiply-adds per
weight byte, below the H100's ridge), but cuBLASLt's FP8 GEMM picks tiles made for large M and the
GEMV's ``[rows, chunk] x [chunk, block_n]`` product puts the few rows on the MMA's large side.
Here a program owns ``BLOCK_N`` weight rows (the MMA's M side, 64 or more: one warpgroup's
``wgmma``) and ``BLOCK_M`` activation rows (the MMA's N side: 16 to 128), streams its
``[BLOCK_N, BLOCK_K]`` chunks of W with a software pipeline of ``num_stages`` loads in flight, and
multiplies them with the activations' chunk transposed:

- ``X_FP8`` on: ``x`` float8 with a float32 scale per row (per-token quantization, done before:
  ``fp8_act_quant``), an FP8 x FP8 MMA, the sums scaled by ``x_scale[m] * w_scale[n]``;
- ``X_FP8`` off (W8A16): ``x`` bf16 / fp16 as it is, the codes converted to x's dtype (exact) in
  registers, a 16-bit MMA, the sums scaled by ``w_scale[n]``: no activation quantization launch.

Loads: pointer loads pipelined by Triton (cp.async), or with ``tma`` the Hopper tensor-memory
accelerator (host-made descriptors of W and x, out-of-bounds tiles zero-filled; K a multiple of 16).

Split K (where the row blocks alone leave SMs idle: o_proj, down_proj) as the GEMV: float32
partials ``[SPLIT, M, N]`` summed with the bias by ``splitk.splitk_sum_kernel``. Launch sizes are a
function of the shape (``mm_config``), never timed at call time (CUDA-graph capturable; the only
allocations are the output and the partials). Requirements (``fits``): a 2-D input with contiguous
rows (float8_e4m3fn with ``[M, 1]`` scales, or bf16 / fp16), a contiguous ``[N, K]``
float8_e4m3fn weight and ``[N]`` scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.quantization.kernels.fp8_gemv import _device_sms, split_k
from pagedllm.quantization.kernels.splitk import splitk_sum_kernel


@triton.jit
def _fp8_mm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_wn,
                   stride_om, HAS_BIAS: tl.constexpr, X_FP8: tl.constexpr, SPLIT_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    """Output rows ``rm`` x columns ``rn`` over one split of K (module doc), accumulated as
    ``[BLOCK_N, BLOCK_M]`` (weight rows first) in float32. With ``TMA`` ``x_ptr`` and ``w_ptr`` are
    tensor descriptors."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    m_mask = rm < M
    k_begin = pid_k * K_PER_SPLIT
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    if TMA:
        for k0 in range(k_begin, tl.minimum(k_begin + K_PER_SPLIT, K), BLOCK_K):
            w = w_ptr.load([pid_n * BLOCK_N, k0])
            x = x_ptr.load([pid_m * BLOCK_M, k0])
            if X_FP8:
                acc = tl.dot(w, tl.trans(x), acc)
            else:
                acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    else:
        w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + (k_begin + rk)[None, :]
        x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + (k_begin + rk)[None, :]
        for k0 in range(k_begin, k_begin + K_PER_SPLIT, BLOCK_K):
            k_mask = (k0 + rk) < K
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if X_FP8:
                acc = tl.dot(w, tl.trans(x), acc)
            else:
                acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    y = acc * tl.load(ws_ptr + rn, mask=n_mask, other=0.0)[:, None]
    if X_FP8:
        y = y * tl.load(xs_ptr + rm, mask=m_mask, other=0.0)[None, :]
    if SPLIT_K:  # float32 partial sums into this split's [M, N] slice
        out = out_ptr + pid_k * M * N
        stride = N
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        out = out_ptr
        stride = stride_om
    tl.store(out + rm[None, :] * stride + rn[:, None], y.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & m_mask[None, :])


Config = tuple[int, int, int, int, int, int, bool]


def mm_config(m: int, n: int, k: int, sm_count: int) -> Config:
    """``(block_m, block_n, block_k, num_warps, num_stages, split, tma)`` for ``m`` rows and an
    ``[n, k]`` weight: all rows in one block up to 128 (each weight chunk read once), 64 weight rows x
    128 columns a chunk (one warpgroup), four chunks in flight, pointer loads; K split until the SMs
    are busy."""
    block_m = max(16, triton.next_power_of_2(min(m, 128)))
    block_n, block_k, num_warps, num_stages = 64, min(128, max(16, triton.next_power_of_2(k))), 4, 4
    blocks_m = triton.cdiv(m, block_m)
    split = split_k(n * blocks_m, k, block_n, block_k, sm_count)
    return block_m, block_n, block_k, num_warps, num_stages, split, False


def fits(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> bool:
    """Whether the kernel takes ``x`` times ``Wq^T`` (module doc)."""
    return (x.dim() == 2 and x.stride(-1) == 1 and x.dtype in (torch.float8_e4m3fn, torch.bfloat16, torch.float16)
            and wq.dim() == 2 and wq.is_contiguous() and wq.dtype == torch.float8_e4m3fn
            and x.shape[1] == wq.shape[1] and w_scale.numel() == wq.shape[0] and w_scale.is_contiguous())


def fp8_mm(x: torch.Tensor, x_scale: torch.Tensor | None, wq: torch.Tensor, w_scale: torch.Tensor,
           bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
           config: Config | None = None) -> torch.Tensor:
    """``[M, N]``: ``(x * x_scale) @ (Wq * w_scale[:, None])^T (+ bias)`` where ``x`` is float8 with
    ``x_scale [M, 1]`` float32, or ``x @ (Wq * w_scale)^T`` for a 16-bit ``x`` (``x_scale`` None:
    W8A16); in ``out_dtype`` (default: x's dtype for a 16-bit x, bf16 for a float8 one);
    ``config`` as ``mm_config`` returns. Precondition: ``fits``."""
    m, k = x.shape
    n = wq.shape[0]
    x_fp8 = x.dtype == torch.float8_e4m3fn
    if x_fp8 != (x_scale is not None):
        raise ValueError("fp8_mm: x_scale goes with a float8 x, and only with one")
    out_dtype = out_dtype or (torch.bfloat16 if x_fp8 else x.dtype)
    block_m, block_n, block_k, num_warps, num_stages, split, tma = config or mm_config(m, n, k, _device_sms(x))
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    b = bias if bias is not None else w_scale
    xs = x_scale if x_fp8 else w_scale
    grid = (triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))
    x_arg, w_arg = x, wq
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_arg = TensorDescriptor.from_tensor(x, [block_m, block_k])
        w_arg = TensorDescriptor.from_tensor(wq, [block_n, block_k])
    _fp8_mm_kernel[grid](x_arg, xs, w_arg, w_scale, b, target, m, n, k, k_per_split, x.stride(0), wq.stride(0),
                         out.stride(0), HAS_BIAS=bias is not None, X_FP8=x_fp8, SPLIT_K=split > 1, BLOCK_M=block_m,
                         BLOCK_N=block_n, BLOCK_K=block_k, TMA=tma, num_warps=num_warps, num_stages=num_stages)
    if split > 1:
        block = 1024
        splitk_sum_kernel[(triton.cdiv(m * n, block),)](target, b, out, m, n, out.stride(0), SPLIT=split,
                                                         HAS_BIAS=bias is not None, BLOCK=block, USE_PDL=False,
                                                         num_warps=4)
    return out
