"""``y = x @ W^T (+ b)`` for GGUF block-quantized weights kept packed on the GPU: Q4_0, Q4_1, Q8_0,
Q4_K, Q5_K and Q6_K, dequantized inside the kernel (each weight byte is read from memory once).

Weight layout: the GGUF tensor's bytes as they are, one row of blocks per output row: ``w`` uint8
``[N, (K / QK) * BLOCK_BYTES]`` (``QK`` weights per block; ``GGUF_BLOCKS`` lists both). Block
layouts (llama.cpp's ``ggml-common.h``; all little-endian, float16 ``d`` / ``dmin`` factors):

- Q4_0 (32 weights, 18 bytes): ``d``, ``qs[16]``; weight ``i`` is ``(nibble - 8) * d``, the low nibble
  of ``qs[i]`` for ``i < 16``, else the high nibble of ``qs[i - 16]``.
- Q4_1 (32, 20): ``d``, ``m``, ``qs[16]``; ``nibble * d + m`` (nibbles as Q4_0).
- Q8_0 (32, 34): ``d``, ``qs[32]`` int8; ``q * d``.
- Q4_K (256, 144): ``d``, ``dmin``, ``scales[12]`` (eight 6-bit scales and mins, packed), ``qs[128]``;
  sub-block ``s = i // 32`` has ``(d * scale_s) * nibble - dmin * min_s``; chunk ``i // 64`` holds
  its two sub-blocks in the low then high nibbles of 32 bytes.
- Q5_K (256, 176): as Q4_K with ``qh[32]`` after the scales: bit ``s`` of ``qh[i % 32]`` is the
  code's fifth bit.
- Q6_K (256, 210): ``ql[128]``, ``qh[64]``, ``scales[16]`` int8, ``d``; each half of 128 weights
  takes 64 ``ql`` bytes (low nibbles, then high) and 32 ``qh`` bytes (2 bits each), code - 32,
  times ``d * scales[i // 16]``.

Kernels (the same per-element decoding, ``_dequantize``, float32 in the order gguf-py computes):
``_gguf_dequant_kernel`` (a float matrix: tests, and large prefills that go through cuBLAS),
``_gguf_gather_kernel`` (the rows of given ids: the embedding lookup),
``_gguf_gemv_kernel`` (up to ``GEMV_MAX_ROWS`` rows: each program streams ``BLOCK_N`` weight rows
for all rows of x) and ``_gguf_gemm_kernel`` (a tiled ``tl.dot`` GEMM on dequantized tiles). No host
sync, no allocation besides the output: they can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# name -> (kernel id, weights per block, bytes per block)
GGUF_BLOCKS = {"Q4_0": (0, 32, 18), "Q4_1": (1, 32, 20), "Q8_0": (2, 32, 34),
               "Q4_K": (3, 256, 144), "Q5_K": (4, 256, 176), "Q6_K": (5, 256, 210)}
# Up to this many rows of x the GEMV decodes each weight once for all of them (a speculative
# verification's 1 + k rows at batch 1 included); above, the tiled GEMM.
GEMV_MAX_ROWS = 8


@triton.jit
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _half(ptr, mask):
    """The little-endian float16 at ``ptr`` (two bytes), as float32."""
    bits = _byte(ptr, mask) | (_byte(ptr + 1, mask) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _signed(byte):
    return tl.where(byte > 127, byte - 256, byte)


@triton.jit
def _scale_min_k4(scales_ptr, s, mask):
    """The 6-bit scale and min of sub-block ``s`` (0..7) of a Q4_K / Q5_K block: ``s < 4`` in the low
    six bits of ``scales[s]`` and ``scales[s + 4]``; else the low (scale) and high (min) nibble of
    ``scales[s + 4]`` with the top two bits of ``scales[s - 4]`` (scale) and ``scales[s]`` (min)."""
    low = s < 4
    b_s = _byte(scales_ptr + s, mask)
    b_s4 = _byte(scales_ptr + s + 4, mask)
    b_prev = _byte(scales_ptr + tl.where(low, s, s - 4), mask)
    scale = tl.where(low, b_s & 63, (b_s4 & 0xF) | ((b_prev >> 6) << 4))
    minimum = tl.where(low, b_s4 & 63, (b_s4 >> 4) | ((b_s >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _dequantize(w_ptr, rn, rk, mask, stride_wn, QTYPE: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """Float32 weights ``W[rn, rk]`` (broadcast shapes) decoded from their blocks (module doc)."""
    i = rk % QK
    base = w_ptr + rn.to(tl.int64) * stride_wn + (rk // QK) * BLOCK_BYTES
    if QTYPE == 0 or QTYPE == 1:  # Q4_0, Q4_1
        qs = base + 2 * QTYPE + 2
        byte = _byte(qs + (i % 16), mask)
        q = tl.where(i < 16, byte & 0xF, byte >> 4)
        if QTYPE == 0:
            w = (q - 8).to(tl.float32) * _half(base, mask)
        else:
            w = _half(base, mask) * q.to(tl.float32) + _half(base + 2, mask)
    elif QTYPE == 2:  # Q8_0
        w = _half(base, mask) * _signed(_byte(base + 2 + i, mask)).to(tl.float32)
    elif QTYPE == 3 or QTYPE == 4:  # Q4_K, Q5_K
        s = i // 32
        scale, minimum = _scale_min_k4(base + 4, s, mask)
        qs = base + 16 + 32 * (QTYPE - 3)
        byte = _byte(qs + (i // 64) * 32 + i % 32, mask)
        q = tl.where(s % 2 == 0, byte & 0xF, byte >> 4)
        if QTYPE == 4:
            q = q | (((_byte(base + 16 + i % 32, mask) >> s) & 1) << 4)
        w = (_half(base, mask) * scale) * q.to(tl.float32) - _half(base + 2, mask) * minimum
    else:  # Q6_K
        half = i // 128
        quarter = (i % 128) // 32
        lane = i % 32
        low_byte = _byte(base + half * 64 + lane + (quarter % 2) * 32, mask)
        nibble = tl.where(quarter < 2, low_byte & 0xF, low_byte >> 4)
        high = (_byte(base + 128 + half * 32 + lane, mask) >> (2 * quarter)) & 3
        scale = _signed(_byte(base + 192 + i // 16, mask)).to(tl.float32)
        w = (_half(base + 208, mask) * scale) * ((nibble | (high << 4)) - 32).to(tl.float32)
    return w


@triton.jit
def _gguf_dequant_kernel(w_ptr, out_ptr, N, K, stride_wn, stride_on, QTYPE: tl.constexpr, QK: tl.constexpr,
                         BLOCK_BYTES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    mask = (rn < N) & (rk < K)
    w = _dequantize(w_ptr, rn, rk, mask, stride_wn, QTYPE, QK, BLOCK_BYTES)
    tl.store(out_ptr + rn * stride_on + rk, w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gguf_gather_kernel(w_ptr, ids_ptr, out_ptr, T, K, stride_wn, stride_ot, QTYPE: tl.constexpr, QK: tl.constexpr,
                        BLOCK_BYTES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    t_mask = rt < T
    rn = tl.load(ids_ptr + rt, mask=t_mask, other=0)[:, None]
    mask = t_mask[:, None] & (rk < K)
    w = _dequantize(w_ptr, rn, rk, mask, stride_wn, QTYPE, QK, BLOCK_BYTES)
    tl.store(out_ptr + rt[:, None].to(tl.int64) * stride_ot + rk, w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gguf_gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                      QTYPE: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_mask, m_mask = rn < N, rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        w = _dequantize(w_ptr, rn[:, None], rk[None, :], n_mask[:, None] & k_mask[None, :], stride_wn,
                        QTYPE, QK, BLOCK_BYTES)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gguf_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                      QTYPE: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr, HAS_BIAS: tl.constexpr,
                      IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    grid_n = tl.cdiv(N, BLOCK_N)
    rm = (pid // grid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % grid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        a = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = _dequantize(w_ptr, rn[None, :], rk[:, None], k_mask[:, None] & n_mask[None, :], stride_wn,
                        QTYPE, QK, BLOCK_BYTES)
        if IEEE:
            acc += tl.dot(a.to(tl.float32), b, input_precision="ieee")
        else:
            acc += tl.dot(a, b.to(x_ptr.dtype.element_ty))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _block(qtype: str, w: torch.Tensor, k: int) -> tuple[int, int, int]:
    if qtype not in GGUF_BLOCKS:
        raise ValueError(f"qtype must be one of {sorted(GGUF_BLOCKS)}, got {qtype!r}")
    kid, qk, nbytes = GGUF_BLOCKS[qtype]
    if k % qk or w.dtype != torch.uint8 or w.shape[1] != k // qk * nbytes or w.stride(1) != 1:
        raise ValueError(f"a {qtype} weight of {k} columns is uint8 [N, {k // qk * nbytes}] with K a multiple "
                         f"of {qk}; got {w.dtype} {tuple(w.shape)}")
    return kid, qk, nbytes


def gguf_dequantize(w: torch.Tensor, qtype: str, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[N, k]`` matrix of a packed ``qtype`` weight ``w`` (module doc) in ``dtype``."""
    kid, qk, nbytes = _block(qtype, w, k)
    n = w.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=w.device)
    grid = (triton.cdiv(n, 16), triton.cdiv(k, 256))
    _gguf_dequant_kernel[grid](w, out, n, k, w.stride(0), out.stride(0), QTYPE=kid, QK=qk, BLOCK_BYTES=nbytes,
                               BLOCK_N=16, BLOCK_K=256)
    return out


def gguf_gather(w: torch.Tensor, qtype: str, k: int, ids: torch.Tensor, dtype: torch.dtype = torch.float32
                ) -> torch.Tensor:
    """Rows ``ids`` (int64 ``[T]``, each in ``[0, N)``) of a packed ``qtype`` weight, ``[T, k]`` in ``dtype``."""
    kid, qk, nbytes = _block(qtype, w, k)
    out = torch.empty(ids.shape[0], k, dtype=dtype, device=w.device)
    grid = (triton.cdiv(ids.shape[0], 16), triton.cdiv(k, 256))
    _gguf_gather_kernel[grid](w, ids, out, ids.shape[0], k, w.stride(0), out.stride(0), QTYPE=kid, QK=qk,
                              BLOCK_BYTES=nbytes, BLOCK_T=16, BLOCK_K=256)
    return out


def gguf_linear(x: torch.Tensor, w: torch.Tensor, qtype: str, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T (+ bias)`` in x's dtype for a packed ``qtype`` weight ``w`` (module doc):
    the GEMV up to ``GEMV_MAX_ROWS`` rows, the tiled GEMM above."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}")
    m, k = x.shape
    kid, qk, nbytes = _block(qtype, w, k)
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    args = (x, w, bias if bias is not None else out, out, m, n, k, x.stride(0), w.stride(0), out.stride(0))
    consts = dict(QTYPE=kid, QK=qk, BLOCK_BYTES=nbytes, HAS_BIAS=bias is not None)
    if m <= GEMV_MAX_ROWS:
        # Narrow layers get 8-row programs (more of them on the GPU); 8 rows of x keep 64 columns
        # per step (the [rows, BLOCK_N, BLOCK_K] product stays in registers).
        block_m = triton.next_power_of_2(m)
        block_n = 16 if n >= 4096 else 8
        _gguf_gemv_kernel[(triton.cdiv(n, block_n),)](*args, **consts, BLOCK_M=block_m, BLOCK_N=block_n,
                                                      BLOCK_K=128 if block_m <= 4 else 64, num_warps=4)
        return out
    block_m, block_n, num_warps = (64, 64, 4) if m <= 128 else (128, 128, 8)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gguf_gemm_kernel[grid](*args, **consts, IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
                            BLOCK_K=32, num_warps=num_warps)
    return out
