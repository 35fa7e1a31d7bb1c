"""Decode GEMVs with the preceding elementwise op folded into their prologue (one launch, not two).

- ``rms_norm_linear``: ``(x, residual) -> (F.linear(rmsnorm(x + residual) * g, W, b), x + residual)``,
  i.e. ``RMSNorm.forward`` followed by ``Linear.forward`` (qkv_proj after input_layernorm, gate_up_proj
  after post_attention_layernorm);
- ``silu_and_mul_linear``: ``[gate | up] -> F.linear(silu(gate) * up, W, b)``, i.e. ``SiluAndMul`` then
  ``Linear`` (down_proj);
- ``rms_norm_qkv_rope``: at one row, ``rms_norm_linear`` on the merged qkv projection with the NeoX
  RoPE of q and k and the KV-cache store in its epilogue (``rotary.qk_norm_rope(..., kv_store=...)``
  without a q/k norm): each program owns dim pairs ``(d, d + D/2)`` of one head, so it can rotate
  what it computed; q heads go to the output, k and v heads to the row's cache slot.

Structure and launch parameters are those of ``skinny_gemm.py``: each program owns ``BLOCK_N``
output columns and streams their ``[BLOCK_N, K]`` slice of W once in ``BLOCK_K`` chunks, for all M
rows (1..4, a compile-time constant), accumulating in float32. The GEMV's input chunk is computed on
the fly from the op's inputs instead of being loaded.

The norm takes one pass: ``rmsnorm(s) * g . w = rstd * (s * g . w)`` with ``s = x + residual``, so
each program accumulates ``s * g . w`` and the sum of squares of ``s`` over the same chunks and
scales by ``rstd`` at the end. (A first pass for ``rstd`` before streaming the weight cost each
kernel an L2 round trip and a second read of the row per program: Llama-8B batch 1 4.113 -> 4.079 ms
per step, Qwen3-0.6B 0.859 -> 0.838 ms on an H200.) Float semantics: the residual add is rounded to
the input dtype, as torch does; the normed row is never rounded (torch rounds ``s * rstd`` and its
product with ``g`` to the input dtype), so the result differs from the two-launch path by about one
rounding of the linear's input (bf16: ~1e-2 relative on a tiny model's logits). ``silu(gate)`` is
rounded to the input dtype and the product rounded again, as torch does.

Invariant: the inputs are never written. The new residual ``x + residual`` goes to a new tensor,
written by program 0 only (every program reads x and residual).

Cost: as the GEMV (N*K weight elements read once from HBM), plus per program the op's input read
from L2: the norm reads each row of x (and residual) and the norm weight once, ``(1 or 2) + 1``
K-element rows; the activation reads ``2 * K`` per row and computes K exps per row. Grid
``cdiv(N, BLOCK_N)``; no host syncs (capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.triton_kernels.kv_store import slot_offset
from pagedllm.layers.kernels.rms_norm import _load_sum
from pagedllm.layers.kernels.rotary import _rotate, _rounded
from pagedllm.layers.kernels.skinny_gemm import _column_block, _store_rows, _weight_chunk, launch_config
from pagedllm.pdl import launch_kwargs
from pagedllm.triton_pdl import allow_dependents, wait_for_inputs

MAX_ROWS = 4


@triton.jit
def _rms_norm_gemv_kernel(x_ptr, res_ptr, g_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, N, K, eps,
                          stride_xm, stride_rm, stride_wn, stride_om, stride_rom,
                          M: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K_CHUNKS: tl.constexpr,
                          USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    store = pid == 0  # program 0 writes the new residual
    rn, n_mask, w_rows = _column_block(w_ptr, N, stride_wn, BLOCK_N)
    wait_for_inputs(USE_PDL)
    acc0 = tl.zeros((BLOCK_N,), tl.float32)
    acc1 = tl.zeros((BLOCK_N,), tl.float32)
    acc2 = tl.zeros((BLOCK_N,), tl.float32)
    acc3 = tl.zeros((BLOCK_N,), tl.float32)
    ss0 = tl.zeros((BLOCK_K,), tl.float32)
    ss1 = tl.zeros((BLOCK_K,), tl.float32)
    ss2 = tl.zeros((BLOCK_K,), tl.float32)
    ss3 = tl.zeros((BLOCK_K,), tl.float32)
    for c in range(NUM_K_CHUNKS):
        rk, k_mask, w = _weight_chunk(w_rows, n_mask, c * BLOCK_K, K, BLOCK_K)
        g = tl.load(g_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
        s0 = _load_sum(x_ptr, res_ptr, res_out_ptr, rk, k_mask, k_mask & store, HAS_RESIDUAL, True)
        ss0 += s0 * s0
        acc0 += tl.sum(w * (s0 * g)[None, :], axis=1)
        if M > 1:
            s1 = _load_sum(x_ptr + stride_xm, res_ptr + stride_rm, res_out_ptr + stride_rom, rk, k_mask,
                           k_mask & store, HAS_RESIDUAL, True)
            ss1 += s1 * s1
            acc1 += tl.sum(w * (s1 * g)[None, :], axis=1)
        if M > 2:
            s2 = _load_sum(x_ptr + 2 * stride_xm, res_ptr + 2 * stride_rm, res_out_ptr + 2 * stride_rom, rk,
                           k_mask, k_mask & store, HAS_RESIDUAL, True)
            ss2 += s2 * s2
            acc2 += tl.sum(w * (s2 * g)[None, :], axis=1)
        if M > 3:
            s3 = _load_sum(x_ptr + 3 * stride_xm, res_ptr + 3 * stride_rm, res_out_ptr + 3 * stride_rom, rk,
                           k_mask, k_mask & store, HAS_RESIDUAL, True)
            ss3 += s3 * s3
            acc3 += tl.sum(w * (s3 * g)[None, :], axis=1)
    allow_dependents(USE_PDL)
    acc0 *= tl.math.rsqrt(tl.sum(ss0, axis=0) / K + eps)
    acc1 *= tl.math.rsqrt(tl.sum(ss1, axis=0) / K + eps)
    acc2 *= tl.math.rsqrt(tl.sum(ss2, axis=0) / K + eps)
    acc3 *= tl.math.rsqrt(tl.sum(ss3, axis=0) / K + eps)
    _store_rows(b_ptr, out_ptr, rn, n_mask, stride_om, acc0, acc1, acc2, acc3, M, HAS_BIAS)


@triton.jit
def _silu_mul_chunk(x_ptr, rk, k_mask, K):
    """One chunk of ``silu(gate) * up`` (gate = columns ``[0, K)`` of the row, up = ``[K, 2K)``) as the
    torch path rounds it, as float32."""
    io_dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + K + rk, mask=k_mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(io_dtype).to(tl.float32)
    return (act * up).to(io_dtype).to(tl.float32)


@triton.jit
def _silu_mul_gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om,
                          M: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          NUM_K_CHUNKS: tl.constexpr, USE_PDL: tl.constexpr):
    rn, n_mask, w_rows = _column_block(w_ptr, N, stride_wn, BLOCK_N)
    wait_for_inputs(USE_PDL)
    acc0 = tl.zeros((BLOCK_N,), tl.float32)
    acc1 = tl.zeros((BLOCK_N,), tl.float32)
    acc2 = tl.zeros((BLOCK_N,), tl.float32)
    acc3 = tl.zeros((BLOCK_N,), tl.float32)
    for c in range(NUM_K_CHUNKS):
        rk, k_mask, w = _weight_chunk(w_rows, n_mask, c * BLOCK_K, K, BLOCK_K)
        x0 = _silu_mul_chunk(x_ptr, rk, k_mask, K)
        acc0 += tl.sum(w * x0[None, :], axis=1)
        if M > 1:
            x1 = _silu_mul_chunk(x_ptr + stride_xm, rk, k_mask, K)
            acc1 += tl.sum(w * x1[None, :], axis=1)
        if M > 2:
            x2 = _silu_mul_chunk(x_ptr + 2 * stride_xm, rk, k_mask, K)
            acc2 += tl.sum(w * x2[None, :], axis=1)
        if M > 3:
            x3 = _silu_mul_chunk(x_ptr + 3 * stride_xm, rk, k_mask, K)
            acc3 += tl.sum(w * x3[None, :], axis=1)
    allow_dependents(USE_PDL)
    _store_rows(b_ptr, out_ptr, rn, n_mask, stride_om, acc0, acc1, acc2, acc3, M, HAS_BIAS)


def _residual_buffers(x: torch.Tensor, residual: torch.Tensor | None, residual_out: torch.Tensor | None):
    """``(res, res_out, residual_out)`` for a norm-prologue kernel: the residual and the new residual's
    buffer (``residual_out``, or a new tensor like ``x``); without a residual, ``x`` for both (unread)."""
    if residual is None:
        return x, x, residual_out
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
    if residual_out is None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return residual, residual_out, residual_out


def _check_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int) -> None:
    assert x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.stride(1) == 1, "x: [1..4, K'] with unit column stride"
    assert weight.shape[1] == k and weight.stride(1) == 1, "weight: [N, K] with unit column stride"
    assert weight.dtype == x.dtype and (bias is None or bias.shape == (weight.shape[0],))


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    residual_out: torch.Tensor | None = None, block_n: int | None = None,
                    block_k: int | None = None, num_warps: int | None = None,
                    num_stages: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward`` then ``Linear.forward`` in one launch: returns ``(y [M, N], new_residual)``.

    ``x`` ``[M, K]`` (1 <= M <= 4, strided rows allowed), ``residual`` None or like ``x``,
    ``norm_weight`` ``[K]`` and ``weight`` ``[N, K]`` in ``x``'s dtype. ``new_residual`` is a new
    tensor ``x + residual`` (``residual_out`` if given), or ``x`` itself when ``residual`` is None.
    ``out`` / ``residual_out`` (optional, contiguous) are written in place; the launch parameters
    default as in ``skinny_gemm.skinny_linear``.
    """
    m, k = x.shape
    n = weight.shape[0]
    _check_gemv(x, weight, bias, k)
    assert norm_weight.shape == (k,) and norm_weight.stride(0) == 1 and norm_weight.dtype == x.dtype
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res, res_out, residual_out = _residual_buffers(x, residual, residual_out)
    block_n, block_k, num_warps = launch_config(x.device, n, k, block_n, block_k, num_warps, norm_prologue=True)
    _rms_norm_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, res, norm_weight, weight, bias if bias is not None else weight, out, res_out, n, k, eps,
        x.stride(0), res.stride(0), weight.stride(0), out.stride(0), res_out.stride(0),
        M=m, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, NUM_K_CHUNKS=triton.cdiv(k, block_k),
        num_warps=num_warps, num_stages=num_stages, **launch_kwargs(x.device),
    )  # fmt: skip
    return out, (residual_out if residual is not None else x)


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, block_n: int | None = None, block_k: int | None = None,
                        num_warps: int | None = None, num_stages: int = 3) -> torch.Tensor:
    """``SiluAndMul`` then ``Linear.forward`` in one launch: ``x`` ``[M, 2*I]`` (1 <= M <= 4, gate then
    up; strided rows allowed), ``weight`` ``[N, I]`` -> a new ``[M, N]`` tensor (or ``out``)."""
    m, k2 = x.shape
    k = k2 // 2
    assert k2 == 2 * k, "x's last dim must be even: [gate | up]"
    n = weight.shape[0]
    _check_gemv(x, weight, bias, k)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps = launch_config(x.device, n, k, block_n, block_k, num_warps)
    _silu_mul_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, n, k, x.stride(0), weight.stride(0), out.stride(0),
        M=m, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, NUM_K_CHUNKS=triton.cdiv(k, block_k),
        num_warps=num_warps, num_stages=num_stages, **launch_kwargs(x.device),
    )  # fmt: skip
    return out


# ---- qkv projection + RoPE + KV store, at one row -------------------------------------------------


@triton.jit
def _rms_norm_qkv_rope_kernel(x_ptr, res_ptr, g_ptr, w_ptr, b_ptr, q_out_ptr, res_out_ptr, pos_ptr, cos_ptr,
                              sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_slots, K, eps, stride_wn,
                              stride_cache, stride_c_blk, stride_c_slot, stride_c_head,
                              NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                              HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr,
                              BLOCK_K: tl.constexpr, NUM_K_CHUNKS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                              USE_PDL: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    pid = tl.program_id(0)
    io_dtype = x_ptr.dtype.element_ty
    # This program's BLOCK_P dim pairs (d, d + HALF) of one head (BLOCK_P divides HALF).
    head = (pid * BLOCK_P) // HALF
    d = (pid * BLOCK_P) % HALF + tl.arange(0, BLOCK_P)
    rows_a = head * HEAD_DIM + d
    rows_b = rows_a + HALF
    rotated = head < NUM_Q_HEADS + NUM_KV_HEADS  # q or k (else v)
    # Before waiting for the kernel that wrote x (pagedllm/pdl.py): the step's metadata and the
    # position's cos/sin rows (q and k programs).
    pos = tl.load(pos_ptr).to(tl.int64)
    slot = tl.load(slot_ptr, mask=num_slots > 0, other=-1).to(tl.int64)
    cos = _rounded(tl.load(cos_ptr + pos * stride_cache + d, mask=rotated & (d < HALF), other=0.0), io_dtype)
    sin = _rounded(tl.load(sin_ptr + pos * stride_cache + d, mask=rotated & (d < HALF), other=0.0), io_dtype)
    wait_for_inputs(USE_PDL)
    w_a = w_ptr + rows_a.to(tl.int64)[:, None] * stride_wn
    w_b = w_ptr + rows_b.to(tl.int64)[:, None] * stride_wn
    acc_a = tl.zeros((BLOCK_P,), tl.float32)
    acc_b = tl.zeros((BLOCK_P,), tl.float32)
    ss = tl.zeros((BLOCK_K,), tl.float32)
    for c in range(NUM_K_CHUNKS):
        rk = c * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        wa = tl.load(w_a + rk[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32)
        wb = tl.load(w_b + rk[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
        s = _load_sum(x_ptr, res_ptr, res_out_ptr, rk, k_mask, k_mask & (pid == 0), HAS_RESIDUAL, True)
        ss += s * s
        xg = s * g
        acc_a += tl.sum(wa * xg[None, :], axis=1)
        acc_b += tl.sum(wb * xg[None, :], axis=1)
    allow_dependents(USE_PDL)
    rstd = tl.math.rsqrt(tl.sum(ss, axis=0) / K + eps)
    acc_a *= rstd
    acc_b *= rstd
    if HAS_BIAS:
        acc_a += tl.load(b_ptr + rows_a).to(tl.float32)
        acc_b += tl.load(b_ptr + rows_b).to(tl.float32)
    # The projection's output as the two-launch path rounds it, then that path's RoPE roundings.
    y1 = _rounded(acc_a, io_dtype)
    y2 = _rounded(acc_b, io_dtype)
    slot_dst = slot_offset(slot, stride_c_blk, stride_c_slot, BLOCK_SIZE)
    if rotated:
        o1, o2 = _rotate(y1, y2, cos, sin, io_dtype)
        if head < NUM_Q_HEADS:
            tl.store(q_out_ptr + rows_a, o1.to(q_out_ptr.dtype.element_ty))
            tl.store(q_out_ptr + rows_b, o2.to(q_out_ptr.dtype.element_ty))
        elif slot >= 0:
            dst = k_cache_ptr + slot_dst + (head - NUM_Q_HEADS) * stride_c_head + d
            tl.store(dst, o1.to(k_cache_ptr.dtype.element_ty))
            tl.store(dst + HALF, o2.to(k_cache_ptr.dtype.element_ty))
    elif slot >= 0:  # v: stored as projected
        dst = v_cache_ptr + slot_dst + (head - NUM_Q_HEADS - NUM_KV_HEADS) * stride_c_head + d
        tl.store(dst, y1.to(v_cache_ptr.dtype.element_ty))
        tl.store(dst + HALF, y2.to(v_cache_ptr.dtype.element_ty))


def qkv_rope_pairs_per_program(block_n: int, head_dim: int) -> int:
    """Dim pairs per program of ``rms_norm_qkv_rope``: ``block_n // 2`` (its launch config's columns),
    halved until it divides ``head_dim // 2`` so that a program never straddles two heads."""
    pairs = max(1, block_n // 2)
    while (head_dim // 2) % pairs:
        pairs //= 2
    return pairs


def rms_norm_qkv_rope(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                      cos_cache: torch.Tensor, sin_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor, q_out: torch.Tensor | None = None,
                      residual_out: torch.Tensor | None = None, block_n: int | None = None,
                      block_k: int | None = None, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm`` -> the merged qkv ``Linear`` -> NeoX RoPE of q and k -> K/V into the paged cache, for
    one token row, in one launch (models without a q/k norm: Llama, Qwen2, Mistral).

    ``x`` ``[1, K]``, ``residual`` None or like ``x``; ``weight`` ``[(Hq + 2 Hkv) * D, K]`` (q, k, v rows);
    ``positions`` ``[>= 1]``; ``cos_cache``/``sin_cache`` ``[max_position, D // 2]`` float32;
    ``kv_cache`` ``[2, num_blocks, block_size, Hkv, D]``; the row's k and v go to slot
    ``slot_mapping[0]`` (nothing is stored when that is negative or ``slot_mapping`` is empty).
    Returns ``(q rotated [1, Hq * D], new_residual)`` as ``rms_norm_linear`` does. The results are those
    of ``rms_norm_linear`` followed by ``rotary.qk_norm_rope(..., kv_store=...)``: the same one-pass norm,
    then the same roundings (the projection rounded to x's dtype, then each RoPE product and sum), up to
    float32 summation order.
    Each program owns ``qkv_rope_pairs_per_program`` pairs of rows ``(d, d + D/2)`` of one head.
    """
    m, k = x.shape
    n = weight.shape[0]
    head_dim = 2 * cos_cache.shape[-1]
    _check_gemv(x, weight, bias, k)
    assert m == 1, "one token row"
    assert n == (num_q_heads + 2 * num_kv_heads) * head_dim and weight.is_contiguous()
    assert norm_weight.shape == (k,) and norm_weight.stride(0) == 1 and norm_weight.dtype == x.dtype
    assert kv_cache.dtype == x.dtype and tuple(kv_cache.shape[3:]) == (num_kv_heads, head_dim)
    assert kv_cache.stride(-1) == 1 and cos_cache.stride(-1) == 1 and sin_cache.stride() == cos_cache.stride()
    if q_out is None:
        q_out = torch.empty((1, num_q_heads * head_dim), dtype=x.dtype, device=x.device)
    res, res_out, residual_out = _residual_buffers(x, residual, residual_out)
    block_n, block_k, num_warps = launch_config(x.device, n, k, block_n, block_k, num_warps, norm_prologue=True)
    pairs = qkv_rope_pairs_per_program(block_n, head_dim)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _rms_norm_qkv_rope_kernel[(n // (2 * pairs),)](
        x, res, norm_weight, weight, bias if bias is not None else weight, q_out, res_out, positions, cos_cache,
        sin_cache, k_cache, v_cache, slot_mapping, slot_mapping.shape[0], k, eps, weight.stride(0),
        cos_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK_P=pairs, BLOCK_K=block_k,
        NUM_K_CHUNKS=triton.cdiv(k, block_k), BLOCK_SIZE=kv_cache.shape[2], num_warps=num_warps, num_stages=3,
        **launch_kwargs(x.device),
    )  # fmt: skip
    return q_out, (residual_out if residual is not None else x)
