"""``y = x[:, perm] @ W^T (+ b)`` for int4 weights in the serving form of ``quantization/int4.py``,
dequantized inside the kernel: the packed codes are read from memory once.

- ``_int4_gemv_kernel`` (``GEMV_MAX_ROWS`` rows or fewer: decode at small batch): each program owns
  ``BLOCK_N`` output rows of W and streams their packed codes (``[BLOCK_N, BLOCK_K / 8]`` words a
  chunk, contiguous along K) for all M rows at once. Nibble ``j`` of word ``i`` multiplies input
  column ``8i + j``: at one row the chunk's inputs load as ``[words, 8]`` tiles against the codes
  as ``[BLOCK_N, words, 8]`` (``WORD_TILES``), else as eight strided dot products over the words.
  The zero point and the scale are applied once per word:
  ``sum_k x_k (q_k - z) s = sum_words s (sum_j x q - z sum_j x)``. Grid ``cdiv(N, BLOCK_N)``.
- more rows: ``_int4_dequant_kernel`` writes W in x's dtype, then cuBLAS multiplies (a tiled
  GEMM dequantizing in registers measured 18-51x slower than bf16 at 16-64 rows on an H100: the
  row-packed codes do not load coalesced as a ``[BLOCK_K, BLOCK_N]`` tile).

The GEMV accumulates in float32 and rounds once to the output dtype; W is rounded to x's dtype
before cuBLAS, as a fused kernel's ``tl.dot`` would. No host sync; the only allocations are the
output and W (from the caching allocator, so a CUDA graph can capture them). Requirements (``fits``): a 2-D contiguous
float input, K a multiple of 8, the group size a multiple of 8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 4
PACK = 8


@triton.jit
def _x_columns(x_ptr, perm_ptr, rm, m_mask, stride_xm, cols, col_mask, HAS_PERM: tl.constexpr):
    """``x[rm, perm[cols]]`` (or ``x[rm, cols]``) as float32 ``[BLOCK_M, len(cols)]``."""
    if HAS_PERM:
        cols = tl.load(perm_ptr + cols, mask=col_mask, other=0)
    ptrs = x_ptr + rm[:, None] * stride_xm + cols[None, :]
    return tl.load(ptrs, mask=m_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _codes_to_float(words, shift):
    """Nibbles ``(words >> shift) & 0xF`` as float32, exactly: the code OR-ed into the mantissa of
    2^23 (0x4B000000) is the float ``2^23 + code``; subtracting 2^23 leaves the code. Two integer
    ops and one add per code instead of an integer-to-float conversion (a quarter-rate instruction
    that would bound the GEMV below the memory bandwidth)."""
    bits = ((words >> shift) & 0xF) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _int4_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, b_ptr, out_ptr, M, N, K, GROUP_SIZE,
                      stride_xm, stride_qn, stride_sn, stride_om,
                      HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WORD_TILES: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rm = tl.arange(0, BLOCK_M)
    m_mask = rm < M
    words = tl.arange(0, BLOCK_K // 8)
    nibbles = tl.arange(0, 8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        wi = k0 // 8 + words  # this chunk's word columns
        w_mask = wi < K // 8
        tile_mask = n_mask[:, None] & w_mask[None, :]
        packed = tl.load(qw_ptr + rn[:, None] * stride_qn + wi[None, :], mask=tile_mask, other=0)
        group = (wi * 8) // GROUP_SIZE
        s = tl.load(s_ptr + rn[:, None] * stride_sn + group[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rn[:, None] * stride_sn + group[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        if WORD_TILES:
            # One row (M == 1): the chunk's inputs as [words, 8] (contiguous, vector loads) against the
            # codes as [BLOCK_N, words, 8]; the sum over the last axis stays in each thread.
            cols = wi[:, None] * 8 + nibbles[None, :]
            col_mask = cols < K
            if HAS_PERM:
                cols = tl.load(perm_ptr + cols, mask=col_mask, other=0)
            x = tl.load(x_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            q = _codes_to_float(packed[:, :, None], nibbles[None, None, :] * 4)
            dot = tl.sum(q * x[None, :, :], axis=2)
            xsum = tl.sum(x, axis=1)
            acc += tl.sum(s * (dot - z * xsum[None, :]), axis=1)[None, :]
        else:
            dot = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 8), tl.float32)
            xsum = tl.zeros((BLOCK_M, BLOCK_K // 8), tl.float32)
            for j in tl.static_range(8):
                xj = _x_columns(x_ptr, perm_ptr, rm, m_mask, stride_xm, wi * 8 + j, w_mask, HAS_PERM)
                dot += xj[:, None, :] * _codes_to_float(packed, 4 * j)[None, :, :]
                xsum += xj
            acc += tl.sum(s[None, :, :] * (dot - z[None, :, :] * xsum[:, None, :]), axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int4_dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, GROUP_SIZE, stride_qn, stride_sn,
                         BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """``W[n, k] = (q[n, k] - z[n, g]) * s[n, g]`` for a ``[BLOCK_N, 8 * BLOCK_W]`` tile, in W's
    dtype. A word's eight codes share one group (the group size is a multiple of 8)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = (rn < N)[:, None] & (rw < K // 8)[None, :]
    words = tl.load(qw_ptr + rn[:, None] * stride_qn + rw[None, :], mask=mask, other=0)
    g = (rw * 8) // GROUP_SIZE
    s = tl.load(s_ptr + rn[:, None] * stride_sn + g[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + rn[:, None] * stride_sn + g[None, :], mask=mask, other=0.0).to(tl.float32)
    shifts = tl.arange(0, 8) * 4
    codes = _codes_to_float(words[:, :, None], shifts[None, None, :])
    w = tl.reshape((codes - z[:, :, None]) * s[:, :, None], (BLOCK_N, BLOCK_W * 8))
    cols = tl.program_id(1) * BLOCK_W * 8 + tl.arange(0, BLOCK_W * 8)
    w_mask = (rn < N)[:, None] & (cols < K)[None, :]
    tl.store(w_ptr + rn[:, None] * K + cols[None, :], w.to(w_ptr.dtype.element_ty), mask=w_mask)


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The ``[N, K]`` weight in ``dtype`` (its columns in the serving form's order: apply ``perm``
    to the input). One read of the codes, one write of the weight."""
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    block_n, block_w = 16, 64
    grid = (triton.cdiv(n, block_n), triton.cdiv(k // PACK, block_w))
    _int4_dequant_kernel[grid](qweight, scales, zeros, w, n, k, group_size, qweight.stride(0), scales.stride(0),
                               BLOCK_N=block_n, BLOCK_W=block_w, num_warps=4)
    return w


def fits(x: torch.Tensor, qweight: torch.Tensor, group_size: int) -> bool:
    """Whether the kernels take ``x`` (module doc)."""
    return (x.dim() == 2 and x.stride(-1) == 1 and qweight.is_contiguous() and group_size % PACK == 0
            and x.shape[1] == qweight.shape[1] * PACK)


def gemv_config(m: int, n: int, k: int) -> tuple[int, int, int, bool]:
    """``(block_n, block_k, num_warps, word_tiles)`` of the GEMV for ``m`` rows and an ``[n, k]``
    weight. Its loop does not overlap one chunk's loads with the next, so a chunk must be large
    (a few KiB of codes per program) while the grid keeps several programs per SM: at one row,
    word tiles of 8 weight rows x 1024 columns (4 KiB); at 2-4 rows, where the strided form holds
    an accumulator per row, 16 x 512. Narrower chunks for short rows."""
    if m == 1:
        return 8, min(1024, triton.next_power_of_2(k)), 4, True
    return 16, min(512, triton.next_power_of_2(k)), 4, False


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                perm: torch.Tensor | None, group_size: int, bias: torch.Tensor | None,
                out: torch.Tensor | None = None, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """``[M, N]`` in x's dtype (``out`` if given); ``config``: the launch sizes of the kernel that
    runs (the GEMV's, ``gemv_config``'s shape; default its). Precondition: ``fits``."""
    m, k = x.shape
    n = qweight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    common = (x, qweight, scales, zeros, perm if perm is not None else qweight, bias if bias is not None else out,
              out, m, n, k, group_size, x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0))
    if m <= GEMV_MAX_ROWS:
        block_n, block_k, num_warps, word_tiles = config or gemv_config(m, n, k)
        _int4_gemv_kernel[(triton.cdiv(n, block_n),)](
            *common, HAS_PERM=perm is not None, HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(m),
            BLOCK_N=block_n, BLOCK_K=block_k, WORD_TILES=word_tiles and m == 1, num_warps=num_warps)
        return out
    # More rows: dequantize once and let cuBLAS multiply. W is written and read back in x's dtype
    # (about twice a bf16 GEMM's bytes), far cheaper at 16+ rows than a fused tiled kernel whose
    # tiles cannot load the row-packed codes coalesced.
    w = int4_dequantize(qweight, scales, zeros, group_size, x.dtype)
    xp = x if perm is None else x.index_select(1, perm)
    torch.matmul(xp, w.t(), out=out)
    if bias is not None:
        out += bias
    return out
