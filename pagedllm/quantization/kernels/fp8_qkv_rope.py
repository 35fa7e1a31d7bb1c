"""Residual add + RMSNorm -> the merged qkv projection with FP8 weights -> NeoX RoPE of q and k ->
K/V into the paged cache, for one token row (batch-1 decode), in one launch: what
``layers/kernels/fused_gemv.rms_norm_qkv_rope`` does for a float weight, for ``Wq [N, K]``
float8_e4m3fn with a float32 scale per row, and for a float cache or a float8 one (values clamped to
its largest finite value and cast, scale 1.0, as ``attention/triton_kernels/kv_store.py`` stores).

Without it the FP8 layer runs the norm + qkv GEMV (``fp8_gemv.rms_norm_fp8_gemv``) and then the RoPE
+ store launch (two with a float8 cache, whose store the RoPE kernel does not take): one or two
launches more per layer of the batch-1 step.

Each program owns ``BLOCK_P`` dim pairs ``(d, d + D/2)`` of one head (so it can rotate what it
computed) and streams their ``2 * BLOCK_P`` weight rows in ``BLOCK_K`` chunks on the CUDA cores, as
the one-row FP8 GEMV does (float32 products per element, reduced once at the end; the next chunk
asked for before this one is multiplied where ``fp8_gemv.PREFETCH``); the norm in one
pass (each program sums the squares of its chunks and scales by ``rstd`` at the end; program 0
writes the new residual). Roundings: the projection rounded to x's dtype, then the RoPE products and
sums as the two-launch path rounds them (``rotary._rotate``). PDL as the GEMV (``pagedllm/pdl.py``):
the position, slot and cos/sin rows before the wait, x after it. Grid ``N / (2 * BLOCK_P)``; no
host sync (capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.triton_kernels.kv_store import slot_offset
from pagedllm.layers.kernels.rms_norm import _load_sum
from pagedllm.layers.kernels.rotary import _rotate, _rounded
from pagedllm.pdl import launch_kwargs
from pagedllm.quantization.kernels import fp8_gemv
from pagedllm.quantization.kernels.fp8_gemv import _weight_chunk
from pagedllm.triton_pdl import allow_dependents, wait_for_inputs

# Launch sizes: 4 pairs (8 weight rows) x 1024 columns a chunk, the one-row GEMV's measured best.
BLOCK_P, BLOCK_K, NUM_WARPS = 4, 1024, 4


@triton.jit
def _store_cache(dst, y1, y2, HALF: tl.constexpr, SATURATE_AT: tl.constexpr):
    if SATURATE_AT > 0:  # a float8 cache: saturate rather than overflow to NaN
        y1 = tl.clamp(y1, -SATURATE_AT, SATURATE_AT)
        y2 = tl.clamp(y2, -SATURATE_AT, SATURATE_AT)
    tl.store(dst, y1.to(dst.dtype.element_ty))
    tl.store(dst + HALF, y2.to(dst.dtype.element_ty))


@triton.jit
def _fp8_qkv_rope_kernel(x_ptr, res_ptr, g_ptr, w_ptr, s_ptr, b_ptr, q_out_ptr, res_out_ptr, pos_ptr, cos_ptr,
                         sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, K, eps, stride_wn, stride_cache,
                         stride_c_blk, stride_c_slot, stride_c_head, NUM_Q_HEADS: tl.constexpr,
                         NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                         HAS_BIAS: tl.constexpr, SATURATE_AT: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_SIZE: tl.constexpr, USE_PDL: tl.constexpr,
                         PREFETCH: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    pid = tl.program_id(0)
    io_dtype = x_ptr.dtype.element_ty
    head = (pid * BLOCK_P) // HALF
    d = (pid * BLOCK_P) % HALF + tl.arange(0, BLOCK_P)
    rows_a = head * HEAD_DIM + d
    rows_b = rows_a + HALF
    rotated = head < NUM_Q_HEADS + NUM_KV_HEADS  # q or k (else v)
    pos = tl.load(pos_ptr).to(tl.int64)
    slot = tl.load(slot_ptr).to(tl.int64)
    cs_mask = (head + d * 0) < NUM_Q_HEADS + NUM_KV_HEADS  # full-shaped: the interpreter takes no scalar mask
    cos = _rounded(tl.load(cos_ptr + pos * stride_cache + d, mask=cs_mask, other=0.0), io_dtype)
    sin = _rounded(tl.load(sin_ptr + pos * stride_cache + d, mask=cs_mask, other=0.0), io_dtype)
    wait_for_inputs(USE_PDL)
    w_a = w_ptr + rows_a.to(tl.int64)[:, None] * stride_wn
    w_b = w_ptr + rows_b.to(tl.int64)[:, None] * stride_wn
    acc_a = tl.zeros((BLOCK_P, BLOCK_K), tl.float32)
    acc_b = tl.zeros((BLOCK_P, BLOCK_K), tl.float32)
    ss = tl.zeros((BLOCK_K,), tl.float32)
    n_mask = d < HALF  # all true: the pairs' rows (a full-shaped mask for _weight_chunk)
    if PREFETCH:
        wa_next = _weight_chunk(w_a, n_mask, tl.arange(0, BLOCK_K), K)
        wb_next = _weight_chunk(w_b, n_mask, tl.arange(0, BLOCK_K), K)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        if PREFETCH:  # as the GEMV: the next chunk asked for before this one is multiplied
            wa, wb = wa_next, wb_next
            wa_next = _weight_chunk(w_a, n_mask, rk + BLOCK_K, K)
            wb_next = _weight_chunk(w_b, n_mask, rk + BLOCK_K, K)
        else:
            wa = _weight_chunk(w_a, n_mask, rk, K)
            wb = _weight_chunk(w_b, n_mask, rk, K)
        s = _load_sum(x_ptr, res_ptr, res_out_ptr, rk, k_mask, k_mask & (rk * 0 + pid == 0), HAS_RESIDUAL, True)
        ss += s * s
        xg = s * tl.load(g_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
        acc_a += wa.to(tl.float32) * xg[None, :]
        acc_b += wb.to(tl.float32) * xg[None, :]
    allow_dependents(USE_PDL)
    rstd = tl.math.rsqrt(tl.sum(ss, axis=0) / K + eps)
    y_a = tl.sum(acc_a, axis=1) * tl.load(s_ptr + rows_a) * rstd  # the GEMV's order: scale, then rstd
    y_b = tl.sum(acc_b, axis=1) * tl.load(s_ptr + rows_b) * rstd
    if HAS_BIAS:
        y_a += tl.load(b_ptr + rows_a).to(tl.float32)
        y_b += tl.load(b_ptr + rows_b).to(tl.float32)
    y1 = _rounded(y_a, io_dtype)
    y2 = _rounded(y_b, io_dtype)
    slot_dst = slot_offset(slot, stride_c_blk, stride_c_slot, BLOCK_SIZE)
    if rotated:
        o1, o2 = _rotate(y1, y2, cos, sin, io_dtype)
        if head < NUM_Q_HEADS:
            tl.store(q_out_ptr + rows_a, o1.to(q_out_ptr.dtype.element_ty))
            tl.store(q_out_ptr + rows_b, o2.to(q_out_ptr.dtype.element_ty))
        elif slot >= 0:
            o1 = _rounded(o1, io_dtype)  # the store path casts the rotated k from x's dtype
            o2 = _rounded(o2, io_dtype)
            _store_cache(k_cache_ptr + slot_dst + (head - NUM_Q_HEADS) * stride_c_head + d, o1, o2, HALF,
                         SATURATE_AT)
    elif slot >= 0:  # v: stored as projected
        _store_cache(v_cache_ptr + slot_dst + (head - NUM_Q_HEADS - NUM_KV_HEADS) * stride_c_head + d, y1, y2, HALF,
                     SATURATE_AT)


def fits(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, wq: torch.Tensor,
         w_scale: torch.Tensor, cos_cache: torch.Tensor, kv_cache: torch.Tensor, num_q_heads: int,
         num_kv_heads: int) -> bool:
    """Whether the kernel takes this call: one bf16 / fp16 row (a residual like it), the norm weight
    ``[K]`` contiguous in x's dtype, a contiguous ``[(Hq + 2 Hkv) * D, K]`` float8 weight with ``[N]``
    scales, a float32 RoPE table over the whole head, a ``[2, blocks, block_size, Hkv, D]`` cache (x's
    dtype or 1-byte float) with a unit last stride, and ``BLOCK_P`` dividing ``D / 2``."""
    if not (x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    k = x.shape[1]
    head_dim = 2 * cos_cache.shape[-1]
    return ((residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                  and residual.stride(-1) == 1))
            and norm_weight.shape == (k,) and norm_weight.dtype == x.dtype and norm_weight.is_contiguous()
            and wq.dtype == torch.float8_e4m3fn and wq.is_contiguous()
            and tuple(wq.shape) == ((num_q_heads + 2 * num_kv_heads) * head_dim, k)
            and w_scale.numel() == wq.shape[0] and w_scale.is_contiguous()
            and cos_cache.dtype == torch.float32 and cos_cache.stride(-1) == 1 and (head_dim // 2) % BLOCK_P == 0
            and kv_cache.dim() == 5 and tuple(kv_cache.shape[3:]) == (num_kv_heads, head_dim)
            and kv_cache.stride(-1) == 1 and (kv_cache.dtype == x.dtype or kv_cache.dtype.is_floating_point
                                              and kv_cache.element_size() == 1))


def fp8_qkv_rope(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                 wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                 cos_cache: torch.Tensor, sin_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                 kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q rotated [1, Hq * D], x + residual)`` with the row's rotated k and its v stored at cache slot
    ``slot_mapping[0]`` (nothing stored where it is negative or absent); without a residual the second
    is ``x``. Precondition: ``fits``."""
    k = x.shape[1]
    n = wq.shape[0]
    head_dim = 2 * cos_cache.shape[-1]
    q_out = torch.empty((1, num_q_heads * head_dim), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else x
    res = residual if residual is not None else x
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if slot_mapping.numel() == 0:  # nothing to store (the kernel reads one slot: a scalar load)
        slot_mapping = torch.full((1,), -1, dtype=torch.int64, device=x.device)
    _fp8_qkv_rope_kernel[(n // (2 * BLOCK_P),)](
        x, res, norm_weight, wq, w_scale, bias if bias is not None else w_scale, q_out, residual_out, positions,
        cos_cache, sin_cache, k_cache, v_cache, slot_mapping, k, eps, wq.stride(0),
        cos_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        SATURATE_AT=float(torch.finfo(kv_cache.dtype).max) if kv_cache.element_size() == 1 else 0.0,
        BLOCK_P=BLOCK_P, BLOCK_K=min(BLOCK_K, triton.next_power_of_2(k)), BLOCK_SIZE=kv_cache.shape[2],
        PREFETCH=fp8_gemv.PREFETCH, num_warps=NUM_WARPS, **launch_kwargs(x.device))
    return q_out, residual_out
