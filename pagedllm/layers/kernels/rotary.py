"""Fused (optional per-head q/k RMSNorm) + NeoX rotary embedding of q and k, in one launch.

For each token ``t`` and head ``h`` of q (then of k), with ``(x1, x2)`` the two halves of the head,
``cos``/``sin`` the cache rows at ``positions[t]`` (float32, cast to the input dtype as HF does):
``x <- weight * rmsnorm(x)`` (when a norm is given), then ``(x1*cos - x2*sin, x2*cos + x1*sin)``.
Every product and sum is rounded to the input dtype where the torch path (``apply_rotary`` after
``RMSNorm``) rounds, and the kernel is compiled without FMA contraction (which would fuse a rounded
product into the next add), so without a norm the results are torch's bit for bit; with one they
differ only where the norm's float32 sum lands differently.

With ``row_scale = (s, eps)`` (the residual-stream forward, ``models/llama.py``: q, k and v come
from a projection of the un-normed stream ``s`` whose weight holds the RMSNorm weight) each program
first scales its heads (and v) by ``rstd = 1 / sqrt(mean(s[t]^2) + eps)`` of its token's row of
``s``, rounding to the input dtype as the projection's output would be.

Grid: ``(num_tokens, q head blocks + k head blocks)``; one program rotates ``BLOCK_H`` heads of one
token. Cost: q and k are read once and written once (new contiguous tensors); the cos/sin rows
(``rotary_dim`` float32 per token) come from L2; with a row scale each program also reads its token's
row of ``s``. Inputs may be strided views (e.g. of the merged
qkv projection's output): only the last dim must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.triton_kernels.kv_store import slot_offset
from pagedllm.pdl import launch_kwargs
from pagedllm.triton_pdl import allow_dependents, wait_for_inputs


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to ``dtype`` and back to float32 (a no-op for float32)."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _load_halves(x_ptr, stride_h, first_head, num_heads, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                 BLOCK_H: tl.constexpr):
    """Heads ``first_head .. first_head + BLOCK_H`` of one token as two float32 halves ``[BLOCK_H, HALF_PAD]``."""
    heads = first_head + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)
    src = x_ptr + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _row_rstd(s_ptr, eps, S_COLS: tl.constexpr, S_PAD: tl.constexpr):
    """``1 / sqrt(mean(s^2) + eps)`` of one row of ``S_COLS`` elements (float32)."""
    cols = tl.arange(0, S_PAD)
    x = tl.load(s_ptr + cols, mask=cols < S_COLS, other=0.0).to(tl.float32)
    return tl.math.rsqrt(tl.sum(x * x, axis=0) / S_COLS + eps)


@triton.jit
def _scaled(x, scale, io_dtype: tl.constexpr, HAS_SCALE: tl.constexpr):
    """``x * scale`` rounded to ``io_dtype`` (as float32), or ``x`` itself without a scale."""
    if HAS_SCALE:
        x = _rounded(x * scale, io_dtype)
    return x


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, pos, stride_cache, io_dtype: tl.constexpr, HALF: tl.constexpr,
             HALF_PAD: tl.constexpr):
    """The cos/sin cache rows at ``pos``, rounded to the input dtype (as HF casts them), as float32."""
    dims = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + pos * stride_cache + dims, mask=dims < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cache + dims, mask=dims < HALF, other=0.0)
    return _rounded(cos, io_dtype), _rounded(sin, io_dtype)


@triton.jit
def _rotate(x1, x2, cos, sin, io_dtype: tl.constexpr):
    """NeoX rotation of the halves ``(x1, x2)`` (float32 holding ``io_dtype`` values) with torch's
    roundings: each product rounded to ``io_dtype``, then the sum; returns float32
    ``(x1*cos - x2*sin, x2*cos + x1*sin)``, still to be rounded by the store. LLVM may fuse a rounded
    product into the next add as one bf16/fp16 FMA: ``qk_norm_rope`` is compiled with
    ``enable_fp_fusion=False`` for that; ``fused_gemv.rms_norm_qkv_rope`` keeps FMAs for its dot
    products, and its GPU test checks that its rotation still equals torch's bit for bit."""
    o1 = _rounded(x1 * cos, io_dtype) - _rounded(x2 * sin, io_dtype)
    o2 = _rounded(x2 * cos, io_dtype) + _rounded(x1 * sin, io_dtype)
    return o1, o2


@triton.jit
def _norm_rope_store(
    x1,
    x2,
    out_ptr,
    w_ptr,
    stride_out_h,
    first_head,
    num_heads,
    cos,
    sin,
    eps,
    io_dtype: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Norm (optional) and rotate the loaded halves of heads ``first_head ..``, and store them."""
    heads = first_head + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)
    if HAS_NORM:
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        x1 = _rounded(_rounded(x1 * rstd[:, None], io_dtype) * w1[None, :], io_dtype)
        x2 = _rounded(_rounded(x2 * rstd[:, None], io_dtype) * w2[None, :], io_dtype)
    o1, o2 = _rotate(x1, x2, cos[None, :], sin[None, :], io_dtype)
    dst = out_ptr + heads[:, None] * stride_out_h + dims[None, :]
    tl.store(dst, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_heads(x_ptr, stride_h, out_ptr, stride_out_h, w_ptr, eps, first_head, num_heads, cos_ptr, sin_ptr, pos,
                stride_cache, row_scale, io_dtype: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr, HAS_ROW_SCALE: tl.constexpr):
    """Heads ``first_head ..`` of one token: load them (before the position's cos/sin rows), scale
    (optional), norm (optional), rotate and store."""
    x1, x2 = _load_halves(x_ptr, stride_h, first_head, num_heads, HALF, HALF_PAD, BLOCK_H)
    x1 = _scaled(x1, row_scale, io_dtype, HAS_ROW_SCALE)
    x2 = _scaled(x2, row_scale, io_dtype, HAS_ROW_SCALE)
    cos, sin = _cos_sin(cos_ptr, sin_ptr, pos, stride_cache, io_dtype, HALF, HALF_PAD)
    _norm_rope_store(x1, x2, out_ptr, w_ptr, stride_out_h, first_head, num_heads, cos, sin, eps, io_dtype, HALF,
                     HALF_PAD, BLOCK_H, HAS_NORM)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    qw_ptr,
    kw_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_qo_tok,
    stride_qo_head,
    stride_ko_tok,
    stride_ko_head,
    stride_cache,
    q_eps,
    k_eps,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_slots,
    stride_v_tok,
    stride_v_head,
    stride_c_blk,
    stride_c_slot,
    stride_c_head,
    s_ptr,
    stride_s,
    s_eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_Q_BLOCKS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STORE_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    S_COLS: tl.constexpr,
    S_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Every load that does not need the position (q or k, v, the slot) is issued before the cos/sin
    # rows that do: two memory round trips per program, not three (the step is latency-bound at
    # small batch).
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    io_dtype = q_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + token).to(tl.int64)  # step metadata: read before the PDL wait
    wait_for_inputs(USE_PDL)
    allow_dependents(USE_PDL)  # one wave, no loop: the next kernel may be placed at once
    row_scale = 1.0
    if HAS_ROW_SCALE:
        row_scale = _row_rstd(s_ptr + token * stride_s, s_eps, S_COLS, S_PAD)
    if head_block < NUM_Q_BLOCKS:
        _rope_heads(
            q_ptr + token * stride_q_tok, stride_q_head, q_out_ptr + token * stride_qo_tok, stride_qo_head, qw_ptr,
            q_eps, head_block * BLOCK_H, NUM_Q_HEADS, cos_ptr, sin_ptr, pos, stride_cache, row_scale, io_dtype,
            HALF, HALF_PAD, BLOCK_H, HAS_NORM, HAS_ROW_SCALE,
        )  # fmt: skip
    elif not STORE_KV:
        _rope_heads(
            k_ptr + token * stride_k_tok, stride_k_head, k_out_ptr + token * stride_ko_tok, stride_ko_head, kw_ptr,
            k_eps, (head_block - NUM_Q_BLOCKS) * BLOCK_H, NUM_KV_HEADS, cos_ptr, sin_ptr, pos, stride_cache,
            row_scale, io_dtype, HALF, HALF_PAD, BLOCK_H, HAS_NORM, HAS_ROW_SCALE,
        )  # fmt: skip
    else:  # rotated k and the untouched v go straight to the token's cache slot (skipped when < 0)
        first_head = (head_block - NUM_Q_BLOCKS) * BLOCK_H
        slot = tl.load(slot_ptr + token, mask=token < num_slots, other=-1).to(tl.int64)
        x1, x2 = _load_halves(k_ptr + token * stride_k_tok, stride_k_head, first_head, NUM_KV_HEADS, HALF, HALF_PAD,
                              BLOCK_H)
        v_heads = first_head + tl.arange(0, BLOCK_H)
        v_dims = tl.arange(0, 2 * HALF_PAD)
        v_mask = (v_heads[:, None] < NUM_KV_HEADS) & (v_dims[None, :] < 2 * HALF)
        v = tl.load(v_ptr + token * stride_v_tok + v_heads[:, None] * stride_v_head + v_dims[None, :], mask=v_mask)
        x1 = _scaled(x1, row_scale, io_dtype, HAS_ROW_SCALE)
        x2 = _scaled(x2, row_scale, io_dtype, HAS_ROW_SCALE)
        if HAS_ROW_SCALE:
            v = (v.to(tl.float32) * row_scale).to(io_dtype)
        cos, sin = _cos_sin(cos_ptr, sin_ptr, pos, stride_cache, io_dtype, HALF, HALF_PAD)
        if slot >= 0:
            dst = slot_offset(slot, stride_c_blk, stride_c_slot, BLOCK_SIZE)
            _norm_rope_store(
                x1, x2, k_cache_ptr + dst, kw_ptr, stride_c_head, first_head, NUM_KV_HEADS, cos, sin, k_eps,
                io_dtype, HALF, HALF_PAD, BLOCK_H, HAS_NORM,
            )  # fmt: skip
            tl.store(v_cache_ptr + dst + v_heads[:, None] * stride_c_head + v_dims[None, :],
                     v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def qk_norm_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    q_norm: tuple[torch.Tensor, float] | None = None,
    k_norm: tuple[torch.Tensor, float] | None = None,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    row_scale: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotated (and, with ``q_norm``/``k_norm`` = ``(weight [head_dim], eps)``, first normed) copies of
    ``q`` ``[T, H, D]`` and ``k`` ``[T, Hkv, D]`` (same dtype, unit last stride, any other strides).

    ``cos_cache``/``sin_cache``: ``[max_position, D // 2]`` float32 (rotary_dim == head_dim);
    ``positions``: ``[T]`` integer. ``q_out``/``k_out`` (optional, shaped like q/k) are written in place.
    Norms come both or neither, with weights in the dtype of q.

    ``kv_store = (value [T, Hkv, D], kv_cache [2, num_blocks, block_size, Hkv, D], slot_mapping [S])``
    fuses the KV store of the attention backend into this launch: the rotated k and ``value`` of
    token ``t`` are written to cache slot ``slot_mapping[t]`` (tokens with a negative slot, or
    ``t >= S``, are skipped) and no k copy is made: the second result is then None.

    ``row_scale = (s [T, C], eps)``: q, k (and the stored value) of token ``t`` are first multiplied by
    ``1 / sqrt(mean(s[t]^2) + eps)`` and rounded to their dtype (``norm.rms_scale`` is the torch
    equivalent); ``s`` has q's dtype and a unit last stride.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = cos_cache.shape[-1]
    assert 2 * half == head_dim and k.shape[2] == head_dim and q.stride(-1) == 1 and k.stride(-1) == 1
    assert cos_cache.stride(-1) == 1 and sin_cache.stride() == cos_cache.stride()
    assert (q_norm is None) == (k_norm is None)
    if q_out is None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if kv_store is not None:
        value, kv_cache, slot_mapping = kv_store
        assert value.shape == k.shape and value.stride(-1) == 1 and kv_cache.stride(-1) == 1
        assert tuple(kv_cache.shape[3:]) == tuple(k.shape[1:]) and kv_cache.dtype == k.dtype
        k_out = None
    elif k_out is None:
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if row_scale is not None:
        stream, s_eps = row_scale
        assert stream.dim() == 2 and stream.shape[0] == num_tokens and stream.stride(-1) == 1
    else:
        stream, s_eps = q, 0.0  # unread
    if num_tokens == 0:
        return q_out, k_out
    half_pad = triton.next_power_of_2(half)
    # Heads per program: a few thousand elements per tile, and no more heads than k has (so q and k
    # split into whole blocks for the common GQA shapes: 16 q + 8 k heads -> 2 + 1 blocks).
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 1024 // half_pad))
    num_q_blocks = triton.cdiv(num_q_heads, block_h)
    grid = (num_tokens, num_q_blocks + triton.cdiv(num_kv_heads, block_h))
    qw, q_eps = q_norm if q_norm is not None else (cos_cache, 0.0)
    kw, k_eps = k_norm if k_norm is not None else (cos_cache, 0.0)
    _qk_norm_rope_kernel[grid](
        q, k, q_out, k_out if k_out is not None else q_out, positions, cos_cache, sin_cache, qw, kw,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1),
        k_out.stride(0) if k_out is not None else 0, k_out.stride(1) if k_out is not None else 0,
        cos_cache.stride(0), q_eps, k_eps,
        *_store_args(kv_store, q),
        stream, stream.stride(0), s_eps,
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        HALF_PAD=half_pad,
        BLOCK_H=block_h,
        NUM_Q_BLOCKS=num_q_blocks,
        HAS_NORM=q_norm is not None,
        STORE_KV=kv_store is not None,
        BLOCK_SIZE=kv_store[1].shape[2] if kv_store is not None else 1,
        HAS_ROW_SCALE=row_scale is not None,
        S_COLS=stream.shape[1] if row_scale is not None else 1,
        S_PAD=triton.next_power_of_2(stream.shape[1]) if row_scale is not None else 1,
        # No FMA contraction: with it LLVM turns ``round(x1*cos) - round(x2*sin)`` into a bf16/fp16
        # multiply and FMA, skipping the rounding of ``x2*sin`` that torch makes (1 ulp off on ~15%
        # of the rotated bf16 elements, measured on an H200).
        enable_fp_fusion=False,
        num_warps=4 if block_h * half_pad >= 512 else 2,
        **launch_kwargs(q.device),
    )  # fmt: skip
    return q_out, k_out


def _store_args(kv_store, q: torch.Tensor) -> tuple:
    """The kernel's KV-store arguments (placeholders that are never read when there is no store)."""
    if kv_store is None:
        return (q, q, q, q, 0, 0, 0, 0, 0, 0)
    value, kv_cache, slot_mapping = kv_store
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    return (value, k_cache, v_cache, slot_mapping, slot_mapping.shape[0], value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
