"""``y = x[:, perm] @ W^T (+ b)`` for int4 weights in the serving form of ``quantization/int4.py``,
dequantized inside the kernel: the packed codes are read from memory once.

- ``_int4_gemv_kernel`` (``GEMV_MAX_ROWS`` rows or fewer: decode at small batch): each program owns
  ``BLOCK_N`` output rows of W and streams their packed codes (``[BLOCK_N, BLOCK_K / 8]`` words a
  chunk, contiguous along K) for all M rows at once. Nibble ``j`` of word ``i`` multiplies input
  column ``8i + j``: at one row the chunk's inputs load as ``[words, 8]`` tiles against the codes
  as ``[BLOCK_N, words, 8]`` (``WORD_TILES``), else as eight strided dot products over the words.
  The zero point and the scale are applied once per word:
  ``sum_k x_k (q_k - z) s = sum_words s (sum_j x q - z sum_j x)``. Grid ``cdiv(N, BLOCK_N)``.
- ``_int4_gemm_kernel`` (more rows): a tiled ``tl.dot`` GEMM whose B tile ``[BLOCK_K, BLOCK_N]`` is
  dequantized from the packed words in registers (each word is loaded for its eight codes: L1 hits,
  one DRAM read); with ``BLOCK_K`` dividing the group size a tile has one scale and zero point per
  column. Grid ``cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)``.

Both accumulate in float32 and round once to the output dtype. No host sync and no allocation
besides the output: both can be captured in a CUDA graph. Requirements (``fits``): a 2-D contiguous
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
def _int4_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, b_ptr, out_ptr, M, N, K, GROUP_SIZE,
                      stride_xm, stride_qn, stride_sn, stride_om,
                      HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, ONE_GROUP: tl.constexpr,
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
        a = _x_columns(x_ptr, perm_ptr, rm, m_mask, stride_xm, rk, k_mask, HAS_PERM)
        b_mask = k_mask[:, None] & n_mask[None, :]
        packed = tl.load(qw_ptr + rn[None, :] * stride_qn + (rk // 8)[:, None], mask=b_mask, other=0)
        q = _codes_to_float(packed, ((rk % 8) * 4)[:, None])
        if ONE_GROUP:
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + rn * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            z = tl.load(z_ptr + rn * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        else:
            g = (rk // GROUP_SIZE)[:, None]
            s = tl.load(s_ptr + rn[None, :] * stride_sn + g, mask=b_mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + rn[None, :] * stride_sn + g, mask=b_mask, other=0.0).to(tl.float32)
        w = (q - z) * s
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a.to(x_ptr.dtype.element_ty), w.to(x_ptr.dtype.element_ty))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


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


def gemm_config(m: int, group_size: int) -> tuple[int, int, int, int]:
    """``(block_m, block_n, block_k, num_warps)`` of the tiled GEMM: 64-wide K steps (32 where the
    group size is not a multiple of 64, so that a step stays in one group when it can), 64x64 tiles
    up to 128 rows, else 128x128 with 8 warps."""
    block_k = 64 if group_size % 64 == 0 else 32
    if m <= 128:
        return 64, 64, block_k, 4
    return 128, 128, block_k, 8


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                perm: torch.Tensor | None, group_size: int, bias: torch.Tensor | None,
                out: torch.Tensor | None = None, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """``[M, N]`` in x's dtype (``out`` if given); ``config``: the launch sizes of the kernel that
    runs (``gemv_config`` / ``gemm_config`` shapes; default theirs). Precondition: ``fits``."""
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
    block_m, block_n, block_k, num_warps = config or gemm_config(m, group_size)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _int4_gemm_kernel[grid](
        *common, HAS_PERM=perm is not None, HAS_BIAS=bias is not None, ONE_GROUP=group_size % block_k == 0,
        IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return out
