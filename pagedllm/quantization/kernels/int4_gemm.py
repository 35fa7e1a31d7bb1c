"""``y = x[:, perm] @ W^T (+ b)`` for int4 weights in the serving form of ``quantization/int4.py``,
dequantized inside the kernel: the packed codes are read from memory once.

Word-row layout (``N8_LAYOUT``, ``[N / 8, K]``: a word holds eight output rows of one input
column; chosen at load where ``n8_layout_fits``):

- ``_int4_gemv_n8_kernel`` (``N8_GEMV_MAX_ROWS`` rows; up to ``GEMV_MAX_ROWS`` where the tiled GEMM
  does not take the input): a program owns ``word_rows`` word rows (eight outputs each) and a split of K; in each
  step its ``THREADS`` threads each take ``RUN`` columns (up to 32) that lie in one group, so a
  thread loads its eight scales and zero points once a step and one ``x`` value serves eight
  codes; the layout stores each 16-byte load of a warp's 32 threads next to each other (512
  contiguous bytes a load). A code costs one logic op (the nibble stays in place in the mantissa
  of 2^23: no shift per code, no int-to-float conversion), one add (minus ``2^23 + z``, exact) and
  one multiply-add; the scale multiplies a step's sums. Grid ``(M, N / 8, split)``: a program per
  input row (a word row's programs run together: the words come from DRAM once), split K
  (``gemv_n8_config``) where the programs alone leave SMs idle, its float32 partial sums added by
  ``splitk.splitk_sum_kernel`` (with the bias, in x's dtype). Act-order: the input columns are
  gathered in the kernel (``perm[cols]``, four scalar loads from L1/L2 a vector). Options (``GemvN8Config``): ``word_rows`` word rows a program (one ``x`` value
  feeds 8 * word_rows codes), ``fold_zero`` (the zero point subtracted once a step from the sums
  instead of once a code: the nibbles read at bits 12 and 16, four shifts a word instead of eight
  adds; float32 keeps 13 bits of the products, so half-precision inputs only), ``hoist`` (the
  step's loads unmasked), ``joint_sum`` (the eight plane sums reduced over the threads in one
  reduction, one exchange between the warps, one store). The GEMV is bound by its instructions
  as much as by the bytes (a word of eight codes costs about 30 instructions: at the copy
  bandwidth an H100 SM would issue three of its four warp instructions a clock): the options cut
  instructions. Under
  programmatic dependent launch (``pagedllm/pdl.py``: the batch-1 decode graph) the GEMV and its
  split-K sum wait for the kernel before and release the next one.
  Not done, measured (H100, 8B shapes, weights cold): the RMSNorm or SiLU-and-mul before the
  projection in the GEMV's prologue, as the FP8 GEMV has them. Every program recomputes the op
  over the whole row, and this GEMV is bound by its instructions, not by the bytes: gate_up took
  51.9 us fused against 30.6 + 1.7 for the GEMV and the norm's own launch, down 23.5 against
  18.5 + 1.3, and the batch-1 decode step 3.71 ms against 2.87 ms.
- ``_int4_gemm_n8_kernel`` (the tiled GEMM, above the GEMV up to ``TILED_MAX_ROWS`` half-precision
  rows): a program owns a ``[BLOCK_M, BLOCK_N]`` output tile and a split of K; a step takes one
  chunk of K (whole GEMV runs of one group: ``tiled_n8_chunk``), loads its ``[BLOCK_N / 8,
  chunk]`` words once, turns them into ``q - z`` in x's dtype in registers (exact), multiplies
  them with the gathered input columns on the tensor cores (float32 accumulate) and scales the
  step's dot by the group's scales. Padding rows up to a 16-row tile cost no weight bytes, so
  2-16 rows cost about what one does. Grid ``(M / BLOCK_M, N / BLOCK_N, split)``; split K
  (``tiled_n8_config``) as the GEMV does. Act-order: the input is permuted by one gather first.
- more rows: ``_int4_dequant_n8_kernel`` writes W in x's dtype, then cuBLAS multiplies
  (``int4_dequant_matmul``; also for float32 inputs, which a dot would round to TF32).

Row layout (``ROWS_LAYOUT``, ``[N, K / 8]``; shapes the word-row GEMV does not take):

- ``_int4_gemv_kernel`` (``GEMV_MAX_ROWS`` rows or fewer): each program owns ``BLOCK_N`` output
  rows of W and streams their packed codes (``[BLOCK_N, BLOCK_K / 8]`` words a chunk, contiguous
  along K) for all M rows at once. Nibble ``j`` of word ``i`` multiplies input column ``8i + j``:
  at one row the chunk's inputs load as ``[words, 8]`` tiles against the codes as ``[BLOCK_N,
  words, 8]`` (``WORD_TILES``), else as eight strided dot products over the words. The zero point
  and the scale are applied once per word: ``sum_k x_k (q_k - z) s = sum_words s (sum_j x q - z
  sum_j x)``. Grid ``cdiv(N, BLOCK_N)``.
- more rows: ``_int4_dequant_kernel`` writes W in x's dtype, then cuBLAS multiplies (a tiled
  GEMM dequantizing in registers over this layout measured 18-51x slower than bf16 at 16-64 rows
  on an H100: the row-packed codes do not load coalesced as a ``[BLOCK_K, BLOCK_N]`` tile).

The kernels accumulate in float32 and round once to the output dtype; W is rounded to x's dtype
before cuBLAS (the tiled GEMM's ``q - z`` needs no rounding: it scales the dot instead). No host sync, no autotuning at call time (the
launch sizes are a function of the shape: CUDA graphs capture them); the only allocations are the
output, the split-K partial sums, the permuted input and W (from the caching allocator, so a CUDA
graph can capture them). Requirements (``fits``): a 2-D contiguous float input, K a multiple of 8,
the group size a multiple of 8.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.pdl import launch_kwargs
from pagedllm.quantization.int4_layout import N8_LAYOUT, PACK, ROWS_LAYOUT, n8_run
from pagedllm.quantization.kernels.splitk import splitk_sum_kernel
from pagedllm.triton_pdl import allow_dependents, wait_for_inputs

GEMV_MAX_ROWS = 4
MAGIC = 0x4B000000  # the bits of the float 2^23, whose mantissa takes a code (``_n8_plane``)
# The word-row GEMV splits K until there are this many programs per SM.
N8_PROGRAMS_PER_SM = 2
# The one-row GEMV's options (``GemvN8Config``), from an H100 sweep of the 8B shapes with the weights
# cold (``benchmarks/gpu/int4_decode_bench.py --gemv-sweep``): one word row a program (two: 0.3 us
# faster on qkv, 0.5-3 us slower on o, gate_up and down), the zero points folded once a step (qkv
# 10.2 -> 8.8 us, gate_up 30.6 -> 29.0, down 18.5 -> 16.7, o 6.8 -> 7.1), the loads not hoisted
# (hoisted: +0.1-4.5 us); two warps a program where the word rows give ``N8_FEW_WARPS_PROGRAMS_PER_SM``
# programs an SM (gate_up: 28.1 us against 29.0 with four; qkv and o lost 0.4-0.9 us with two).
N8_WORD_ROWS = 1
N8_FOLD_ZERO = True
N8_HOIST = False
N8_JOINT_SUM = False
N8_FEW_WARPS_PROGRAMS_PER_SM = 8
# Word-row layout: rows the GEMV takes (one: its per-row sums cost registers and a second row
# doubles its arithmetic), and rows the tiled GEMM takes (above: dequantize once + cuBLAS, whose
# tiles reuse each weight across many rows).
# (H100: at 2 rows the GEMV took 0.65-0.69x of bf16 on the 8B MLP shapes, the tiled GEMM 0.9x; at
# 4 rows 1.1-1.3x against 0.9x. At 128 rows dequantize + cuBLAS was 1.6x faster than tiled.)
N8_GEMV_MAX_ROWS = 2
TILED_MAX_ROWS = 64
# Input columns a tiled-GEMM step covers at most; the most K splits it makes, and the programs per
# SM it splits K towards, by row tile (each streams weights: small row tiles need more of them in
# flight; an H100 sweep of splits 1-8 at 16 and 64 rows on the 8B shapes picked these).
TILED_MAX_CHUNK = 128
TILED_MAX_SPLIT = 8
TILED_PROGRAMS_PER_SM = {16: 6, 32: 4, 64: 2}
# The tiled GEMM's codes as 16-bit floats ``base + q`` (q in 0..15 in the low mantissa bits of
# ``base``, whose ulp is 1): (bits of base, base) per input dtype.
CODE_BASES = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


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


@triton.jit
def _n8_x_tile(x_row, cols, K, perm_ptr, HAS_PERM: tl.constexpr, HOIST: tl.constexpr):
    """``x[row, cols]`` (act-order, ``HAS_PERM``: ``x[row, perm[cols]]``) as float32 ``[THREADS, 4]``
    (``cols`` ``[THREADS, 4]``: four consecutive columns a thread, one vector load; with ``perm``
    one vector load of their input columns and four gathered loads from L1/L2, instead of a gather
    launch before the GEMV). The mask (``cols < K``, always true) keeps the compiler from hoisting
    every step's loads together (``HOIST`` drops it: measured no faster on an H100)."""
    if HAS_PERM:
        cols = tl.load(perm_ptr + cols, mask=cols < K, other=0)
    if HOIST:
        return tl.load(x_row + cols).to(tl.float32)
    return tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)


@triton.jit
def _n8_constants(s_ptr, z_ptr, rows, stride_sn, g, SHIFT: tl.constexpr):
    """``(s * 2^-SHIFT, 2^23 + z * 2^SHIFT)`` float32 ``[THREADS, WORD_ROWS]`` of outputs ``rows``
    (``[WORD_ROWS]``: one plane of each word row) in each thread's group ``g`` (``[THREADS]``): the
    plane's scale with the place value of its nibble taken out, and the float that ``_n8_plane``
    subtracts (an integer below 2^24: exact)."""
    offs = rows[None, :] * stride_sn + g[:, None]
    s = tl.load(s_ptr + offs).to(tl.float32)
    z = tl.load(z_ptr + offs).to(tl.float32)
    return s * (1.0 / (1 << SHIFT)), z * (1 << SHIFT) + 8388608.0


@triton.jit
def _n8_plane(part, words, SHIFT: tl.constexpr, c, xv, magic, FOLD_ZERO: tl.constexpr):
    """Adds one plane's products to ``part`` (``[THREADS, WORD_ROWS, 4]``: a sum per element, one
    multiply-add a product). The nibble at bits ``SHIFT .. SHIFT+3`` of ``words`` (``SHIFT`` <= 16:
    inside the 23 mantissa bits) stays in place in the mantissa of 2^23 (``magic`` = 0x4B000000: the
    float ``v = 2^23 + q * 2^SHIFT``, one logic op); ``v - c`` is ``(q - z) * 2^SHIFT``, exactly (one
    add), then one fused multiply-add by ``x`` (``xv`` ``[THREADS, 4]``). ``FOLD_ZERO``: no add
    here; ``_n8_step_sum`` subtracts ``c`` times the sum of ``x`` once a step (``SHIFT`` 12 or 16
    keeps the sum of ``v * x`` within 2^11 of the products' size: float32 loses 11 of its 24 bits)."""
    bits = (words & (15 << SHIFT)) | magic
    v = bits.to(tl.float32, bitcast=True)
    if not FOLD_ZERO:
        v = v - c[:, :, None]
    return part + v * xv[:, None, :]


@triton.jit
def _n8_step_sum(part, s, c, xsum, FOLD_ZERO: tl.constexpr):
    """One plane's scaled sums of a step, ``[THREADS, WORD_ROWS]``: ``s * sum(part)`` (minus ``c *
    sum(x)`` first where ``_n8_plane`` left the zero point and the 2^23 in, ``FOLD_ZERO``)."""
    p = tl.sum(part, axis=2)
    if FOLD_ZERO:
        p = p - c * xsum[:, None]
    return p * s


@triton.jit
def _n8_store(out_ptr, acc, rows, b_ptr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """Stores one plane's outputs (``acc`` ``[THREADS, WORD_ROWS]`` summed over the threads) at
    ``out_ptr + rows``: with the bias and in out's dtype, or (split K) as float32 partial sums
    (``out_ptr`` in this split's ``[M, N]`` slice)."""
    y = tl.sum(acc, axis=0)
    if SPLIT == 1 and HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty))


@triton.jit
def _n8_store_planes(out_ptr, a0, a1, a2, a3, a4, a5, a6, a7, rows, b_ptr, HAS_BIAS: tl.constexpr,
                     SPLIT: tl.constexpr):
    """``_n8_store`` of all eight planes at once: the ``[THREADS, WORD_ROWS]`` sums stacked into
    ``[THREADS, WORD_ROWS, 8]`` (plane ``j`` at ``j``) and reduced over the threads in one reduction
    (one exchange between the warps instead of eight), then one store of 8 outputs a word row."""
    # ``tl.join`` adds its axis last: join(join(p, q), join(r, s)) reshaped is (p, r, q, s).
    lo = tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (a0.shape[0], a0.shape[1], 4))
    hi = tl.reshape(tl.join(tl.join(a4, a6), tl.join(a5, a7)), (a0.shape[0], a0.shape[1], 4))
    planes = tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 3, 2)), (a0.shape[0], a0.shape[1], 8))
    y = tl.sum(planes, axis=0)
    cols = rows[:, None] + tl.arange(0, 8)[None, :]
    if SPLIT == 1 and HAS_BIAS:
        y += tl.load(b_ptr + cols).to(tl.float32)
    tl.store(out_ptr + cols, y.to(out_ptr.dtype.element_ty))


@triton.jit
def _int4_gemv_n8_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, b_ptr, out_ptr, M, N, K, GROUP_SIZE, K_PER_SPLIT,
                         stride_xm, stride_sn, stride_om, magic, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                         SPLIT: tl.constexpr,
                         THREADS: tl.constexpr, RUN: tl.constexpr, WORD_ROWS: tl.constexpr,
                         FOLD_ZERO: tl.constexpr, HOIST: tl.constexpr, JOINT_SUM: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """One input row ``m`` against ``WORD_ROWS`` word rows (word row ``b`` holds outputs ``8b ..
    8b+7``, plane ``j`` = output ``8b + j``) over one split of K: ``y[m, 8b+j] = sum_k x[m, k] (q -
    z) s``. The rows of ``x`` are separate programs next to each other in the grid, so a word row's
    programs run together and all but the first read its words from L2. A step covers ``THREADS *
    RUN`` columns: thread ``t`` takes the ``RUN`` columns from ``t * RUN`` on (inside one group), so
    its scales and zero points load once a step, and each ``x`` value feeds the eight planes of
    every word row; the layout stores load ``r`` of a warp's 32 threads as 512
    contiguous bytes (``int4.n8_memory_order``, whose run ``RUN`` is). Exact planes (``FOLD_ZERO``
    off): 0-4 read the word in place, 5-7 the word shifted by 12; folded: plane pairs (0, 1), (2,
    3), (4, 5), (6, 7) read the word shifted to put them at bits 12 and 16 (four shifts a word, and
    one add a word for the sum of ``x`` instead of one a code). ``magic`` (0x4B000000) comes as an
    argument so that it sits in one register and the nibble masks are the logic op's immediates.
    ``SPLIT`` > 1: float32 partial sums into ``out_ptr`` (``[SPLIT, M, N]``), the bias and the
    rounding left to ``splitk.splitk_sum_kernel``. ``USE_PDL``: programmatic dependent launch
    (``pagedllm/pdl.py``): the wait before the first read of x, the release after the loop."""
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_k = tl.program_id(2)
    t = tl.arange(0, THREADS)
    e = tl.arange(0, 4)
    x_row = x_ptr + pid_m * stride_xm
    b = pid_b * WORD_ROWS + tl.arange(0, WORD_ROWS)
    rows = b * 8  # plane 0 of each word row
    word_rows = qw_ptr + b.to(tl.int64)[None, :, None] * K
    acc0 = tl.zeros((THREADS, WORD_ROWS), tl.float32)
    acc1 = tl.zeros_like(acc0)
    acc2 = tl.zeros_like(acc0)
    acc3 = tl.zeros_like(acc0)
    acc4 = tl.zeros_like(acc0)
    acc5 = tl.zeros_like(acc0)
    acc6 = tl.zeros_like(acc0)
    acc7 = tl.zeros_like(acc0)
    # Each plane's bit offset in the word it reads (module doc of the kernel).
    S0: tl.constexpr = 12 if FOLD_ZERO else 0
    S1: tl.constexpr = 16 if FOLD_ZERO else 4
    S2: tl.constexpr = 12 if FOLD_ZERO else 8
    S3: tl.constexpr = 16 if FOLD_ZERO else 12
    S4: tl.constexpr = 12 if FOLD_ZERO else 16
    S5: tl.constexpr = 16 if FOLD_ZERO else 8
    S6: tl.constexpr = 12
    S7: tl.constexpr = 16
    k_begin = pid_k * K_PER_SPLIT
    wait_for_inputs(USE_PDL)
    for kb in range(k_begin, k_begin + K_PER_SPLIT, THREADS * RUN):
        run0 = kb + t * RUN
        g = run0 // GROUP_SIZE
        s0, c0 = _n8_constants(s_ptr, z_ptr, rows, stride_sn, g, S0)
        s1, c1 = _n8_constants(s_ptr, z_ptr, rows + 1, stride_sn, g, S1)
        s2, c2 = _n8_constants(s_ptr, z_ptr, rows + 2, stride_sn, g, S2)
        s3, c3 = _n8_constants(s_ptr, z_ptr, rows + 3, stride_sn, g, S3)
        s4, c4 = _n8_constants(s_ptr, z_ptr, rows + 4, stride_sn, g, S4)
        s5, c5 = _n8_constants(s_ptr, z_ptr, rows + 5, stride_sn, g, S5)
        s6, c6 = _n8_constants(s_ptr, z_ptr, rows + 6, stride_sn, g, S6)
        s7, c7 = _n8_constants(s_ptr, z_ptr, rows + 7, stride_sn, g, S7)
        p0 = tl.zeros((THREADS, WORD_ROWS, 4), tl.float32)
        p1 = tl.zeros_like(p0)
        p2 = tl.zeros_like(p0)
        p3 = tl.zeros_like(p0)
        p4 = tl.zeros_like(p0)
        p5 = tl.zeros_like(p0)
        p6 = tl.zeros_like(p0)
        p7 = tl.zeros_like(p0)
        xs = tl.zeros((THREADS, 4), tl.float32)
        for r in tl.static_range(RUN // 4):
            cols = run0[:, None] + 4 * r + e[None, :]
            stored = kb + (t // 32 * 32 * RUN + 128 * r + 4 * (t % 32))[:, None] + e[None, :]
            words = tl.load(word_rows + stored[:, None, :], eviction_policy="evict_first")
            xv = _n8_x_tile(x_row, cols, K, perm_ptr, HAS_PERM, HOIST)
            if FOLD_ZERO:
                xs += xv
                lo = words << 12
                p0 = _n8_plane(p0, lo, S0, c0, xv, magic, FOLD_ZERO)
                p1 = _n8_plane(p1, lo, S1, c1, xv, magic, FOLD_ZERO)
                mid = words << 4
                p2 = _n8_plane(p2, mid, S2, c2, xv, magic, FOLD_ZERO)
                p3 = _n8_plane(p3, mid, S3, c3, xv, magic, FOLD_ZERO)
                upper = words >> 4
                p4 = _n8_plane(p4, upper, S4, c4, xv, magic, FOLD_ZERO)
                p5 = _n8_plane(p5, upper, S5, c5, xv, magic, FOLD_ZERO)
            else:
                p0 = _n8_plane(p0, words, S0, c0, xv, magic, FOLD_ZERO)
                p1 = _n8_plane(p1, words, S1, c1, xv, magic, FOLD_ZERO)
                p2 = _n8_plane(p2, words, S2, c2, xv, magic, FOLD_ZERO)
                p3 = _n8_plane(p3, words, S3, c3, xv, magic, FOLD_ZERO)
                p4 = _n8_plane(p4, words, S4, c4, xv, magic, FOLD_ZERO)
            high = words >> 12
            if not FOLD_ZERO:
                p5 = _n8_plane(p5, high, S5, c5, xv, magic, FOLD_ZERO)
            p6 = _n8_plane(p6, high, S6, c6, xv, magic, FOLD_ZERO)
            p7 = _n8_plane(p7, high, S7, c7, xv, magic, FOLD_ZERO)
        xsum = tl.sum(xs, axis=1)
        acc0 += _n8_step_sum(p0, s0, c0, xsum, FOLD_ZERO)
        acc1 += _n8_step_sum(p1, s1, c1, xsum, FOLD_ZERO)
        acc2 += _n8_step_sum(p2, s2, c2, xsum, FOLD_ZERO)
        acc3 += _n8_step_sum(p3, s3, c3, xsum, FOLD_ZERO)
        acc4 += _n8_step_sum(p4, s4, c4, xsum, FOLD_ZERO)
        acc5 += _n8_step_sum(p5, s5, c5, xsum, FOLD_ZERO)
        acc6 += _n8_step_sum(p6, s6, c6, xsum, FOLD_ZERO)
        acc7 += _n8_step_sum(p7, s7, c7, xsum, FOLD_ZERO)
    allow_dependents(USE_PDL)
    out = out_ptr + pid_m * stride_om if SPLIT == 1 else out_ptr + pid_k * M * N + pid_m * N
    if JOINT_SUM:
        _n8_store_planes(out, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, rows, b_ptr, HAS_BIAS, SPLIT)
        return
    _n8_store(out, acc0, rows, b_ptr, HAS_BIAS, SPLIT)
    _n8_store(out, acc1, rows + 1, b_ptr, HAS_BIAS, SPLIT)
    _n8_store(out, acc2, rows + 2, b_ptr, HAS_BIAS, SPLIT)
    _n8_store(out, acc3, rows + 3, b_ptr, HAS_BIAS, SPLIT)
    _n8_store(out, acc4, rows + 4, b_ptr, HAS_BIAS, SPLIT)
    _n8_store(out, acc5, rows + 5, b_ptr, HAS_BIAS, SPLIT)
    _n8_store(out, acc6, rows + 6, b_ptr, HAS_BIAS, SPLIT)
    _n8_store(out, acc7, rows + 7, b_ptr, HAS_BIAS, SPLIT)


@triton.jit
def _int4_dequant_n8_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, GROUP_SIZE, stride_sn,
                            RUN: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):
    """``W[8b + j, k] = (q - z) * s`` from the word-row layout (``int4.N8_LAYOUT``, its columns
    stored in ``int4.n8_memory_order`` for ``RUN``), a ``[BLOCK_B, BLOCK_K]`` tile of words (eight
    output rows each) per program, in W's dtype."""
    rb = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rb < N // 8)[:, None] & (rk < K)[None, :]
    in_tile = rk % (32 * RUN)
    stored = rk - in_tile + 128 * (in_tile % RUN // 4) + 4 * (in_tile // RUN) + rk % 4
    words = tl.load(qw_ptr + rb[:, None].to(tl.int64) * K + stored[None, :], mask=mask, other=0)
    g = rk // GROUP_SIZE
    for j in tl.static_range(8):
        rows = rb * 8 + j
        offs = rows[:, None] * stride_sn + g[None, :]
        s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = (_codes_to_float(words, 4 * j) - z) * s
        tl.store(w_ptr + rows[:, None].to(tl.int64) * K + rk[None, :], w.to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int4_gemm_n8_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K, GROUP_SIZE,
                         K_PER_SPLIT, stride_xm, stride_sn, stride_om, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RUN: tl.constexpr, CHUNK: tl.constexpr,
                         CODE_BITS: tl.constexpr, CODE_BASE: tl.constexpr):
    """The tiled GEMM over the word-row layout, computed transposed (``W x^T``: the weight tile is
    the dot's 64-row operand, so 16 input rows fill a tensor-core tile): a ``[BLOCK_N, BLOCK_M]``
    tile of ``out^T`` over one split of K, ``CHUNK`` columns a step. A chunk is ``CHUNK / RUN``
    consecutive GEMV runs inside one group (``tiled_n8_chunk``): the contiguous input columns ``k0
    .. k0 + CHUNK``, whose words lie in 16-byte pieces (four columns of one run) 512 bytes apart
    (``n8_memory_order``). A step loads the ``[BLOCK_N / 8, CHUNK]`` words (each read once) and the
    ``[BLOCK_M, CHUNK]`` inputs; a code becomes the 16-bit float ``CODE_BASE + q`` by two logic ops
    (OR-ed into the mantissa of ``CODE_BASE``, whose bits are ``CODE_BITS``: exact, no conversion),
    the dot accumulates in float32, and the group's zero point and scale are applied to its sums:
    ``s (dot(W', x) - (CODE_BASE + z) sum(x))``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rm < M
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    c = tl.arange(0, CHUNK)
    # Where column k0 + c sits after its chunk's first stored word: load (c % RUN) // 4 of run c // RUN.
    stored_offs = 128 * (c % RUN // 4) + 4 * (c // RUN) + c % 4
    stored_offs = tl.max_contiguous(tl.multiple_of(stored_offs, 4), 4)  # 16-byte pieces: vector loads
    shifts = 4 * tl.arange(0, 8)
    word_rows = qw_ptr + rb[:, None].to(tl.int64) * K + stored_offs[None, :]
    x_rows = x_ptr + rm[:, None] * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    k_begin = pid_k * K_PER_SPLIT
    for k0 in range(k_begin, k_begin + K_PER_SPLIT, CHUNK):
        q = k0 % (32 * RUN) // CHUNK  # the chunk's place in its tile of 32 runs
        words = tl.load(word_rows + (k0 - q * CHUNK + q * (4 * CHUNK // RUN)))
        xt = tl.load(x_rows + (k0 + c)[None, :], mask=m_mask[:, None], other=0.0)
        g = k0 // GROUP_SIZE
        s = tl.load(s_ptr + rn * stride_sn + g).to(tl.float32)
        z = tl.load(z_ptr + rn * stride_sn + g).to(tl.float32)
        bits = ((words[:, None, :] >> shifts[None, :, None]) & 0xF) | CODE_BITS
        w = tl.reshape(bits.to(tl.int16).to(xt.dtype, bitcast=True), (BLOCK_N, CHUNK))
        xsum = tl.sum(xt.to(tl.float32), axis=1)
        acc += (tl.dot(w, tl.trans(xt)) - (z + CODE_BASE)[:, None] * xsum[None, :]) * s[:, None]
    if SPLIT > 1:
        out_ptr += pid_k * M * N
        stride_om = N
    elif HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)[:, None]
    tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[None, :])


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype, layout: str = ROWS_LAYOUT) -> torch.Tensor:
    """The ``[N, K]`` weight in ``dtype`` (its columns in the serving form's order: apply ``perm``
    to the input) from either layout. One read of the codes, one write of the weight."""
    if layout == N8_LAYOUT:
        n, k = qweight.shape[0] * PACK, qweight.shape[1]
        w = torch.empty(n, k, dtype=dtype, device=qweight.device)
        block_b, block_k = 4, 128
        grid = (triton.cdiv(n // PACK, block_b), triton.cdiv(k, block_k))
        _int4_dequant_n8_kernel[grid](qweight, scales, zeros, w, n, k, group_size, scales.stride(0),
                                      RUN=n8_run(k, group_size), BLOCK_B=block_b, BLOCK_K=block_k, num_warps=4)
        return w
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    block_n, block_w = 16, 64
    grid = (triton.cdiv(n, block_n), triton.cdiv(k // PACK, block_w))
    _int4_dequant_kernel[grid](qweight, scales, zeros, w, n, k, group_size, qweight.stride(0), scales.stride(0),
                               BLOCK_N=block_n, BLOCK_W=block_w, num_warps=4)
    return w


def num_outputs(qweight: torch.Tensor, layout: str) -> int:
    """N of a packed weight in ``layout``."""
    return qweight.shape[0] * PACK if layout == N8_LAYOUT else qweight.shape[0]


def in_features(qweight: torch.Tensor, layout: str) -> int:
    """K of a packed weight in ``layout``."""
    return qweight.shape[1] if layout == N8_LAYOUT else qweight.shape[1] * PACK


def fits(x: torch.Tensor, qweight: torch.Tensor, group_size: int, layout: str = ROWS_LAYOUT) -> bool:
    """Whether the kernels take ``x`` (module doc)."""
    return (x.dim() == 2 and x.stride(-1) == 1 and qweight.is_contiguous() and group_size % PACK == 0
            and x.shape[1] == in_features(qweight, layout))


def gemv_config(m: int, n: int, k: int) -> tuple[int, int, int, bool]:
    """``(block_n, block_k, num_warps, word_tiles)`` of the GEMV for ``m`` rows and an ``[n, k]``
    weight. Its loop does not overlap one chunk's loads with the next, so a chunk must be large
    (a few KiB of codes per program) while the grid keeps several programs per SM: at one row,
    word tiles of 8 weight rows x 1024 columns (4 KiB); at 2-4 rows, where the strided form holds
    an accumulator per row, 16 x 512. Narrower chunks for short rows."""
    if m == 1:
        return 8, min(1024, triton.next_power_of_2(k)), 4, True
    return 16, min(512, triton.next_power_of_2(k)), 4, False


def n8_layout_fits(k: int, group_size: int) -> bool:
    """Whether a weight of ``k`` inputs and ``group_size`` suits the word-row GEMV: it has a run
    (``int4.n8_run``: K a multiple of 128)."""
    return n8_run(k, group_size) is not None


@functools.cache
def num_sms(device_index: int) -> int:
    """The SM count of CUDA device ``device_index`` (cached)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


class GemvN8Config(NamedTuple):
    """Launch sizes of the word-row GEMV (``_int4_gemv_n8_kernel``): warps a program, the layout's run,
    K splits, word rows a program (dividing N / 8), and whether the zero points are subtracted once
    a step instead of once a code (``FOLD_ZERO``), and whether the step's loads may all be issued
    at once (``HOIST``: more registers, more bytes in flight)."""

    num_warps: int
    run: int
    split: int
    word_rows: int = 1
    fold_zero: bool = False
    hoist: bool = False
    joint_sum: bool = False


def gemv_n8_config(m: int, n: int, k: int, group_size: int, sm_count: int) -> GemvN8Config:
    """The word-row GEMV's launch for ``m`` rows and an ``[n, k]`` weight: the layout's run
    (``int4.n8_run``), four warps where K allows (more warps resident to hide the memory latency;
    two where the word rows alone give ``N8_FEW_WARPS_PROGRAMS_PER_SM`` programs an SM),
    ``N8_WORD_ROWS`` word rows a program where they divide N / 8, ``N8_FOLD_ZERO``, ``N8_HOIST``,
    and K split until there are ``N8_PROGRAMS_PER_SM`` programs per SM, each split a whole number of
    steps."""
    run = n8_run(k, group_size)
    most = 2 if m * n // PACK >= N8_FEW_WARPS_PROGRAMS_PER_SM * sm_count else 4
    num_warps = next(w for w in (4, 2, 1) if w <= most and k % (32 * w * run) == 0)
    steps = k // (32 * num_warps * run)
    word_rows = N8_WORD_ROWS if (n // PACK) % N8_WORD_ROWS == 0 else 1
    programs = m * n // PACK // word_rows  # a program per input row and word_rows word rows
    split = next((d for d in range(1, steps + 1) if steps % d == 0 and programs * d >= N8_PROGRAMS_PER_SM * sm_count),
                 steps)
    return GemvN8Config(num_warps, run, split, word_rows, N8_FOLD_ZERO, N8_HOIST, N8_JOINT_SUM)


def tiled_n8_chunk(k: int, group_size: int) -> tuple[int, int] | None:
    """``(run, chunk)`` of the tiled GEMM's K step over a word-row weight of ``k`` inputs: ``chunk``
    columns (at most ``TILED_MAX_CHUNK``) = ``chunk / run`` whole GEMV runs inside one group; None
    where the layout's tiles of ``32 * run`` columns and the groups do not nest (or a chunk would
    be shorter than a dot's 16)."""
    run = n8_run(k, group_size)
    if run is None:
        return None
    tile = 32 * run
    if group_size % tile and tile % group_size:
        return None
    chunk = max(run, min(TILED_MAX_CHUNK, tile, group_size))
    return (run, chunk) if chunk >= 16 else None


def tiled_n8_fits(x: torch.Tensor, n: int, group_size: int) -> bool:
    """Whether the tiled GEMM takes ``x`` against a word-row weight of ``n`` outputs: a half-precision
    input (a float32 one would multiply in TF32) and whole ``[16, chunk]`` tiles."""
    return (x.dtype in (torch.float16, torch.bfloat16) and n % 16 == 0
            and tiled_n8_chunk(x.shape[1], group_size) is not None)


def tiled_n8_config(m: int, n: int, k: int, group_size: int, sm_count: int) -> tuple[int, int, int, int, int]:
    """``(block_m, block_n, split_k, num_warps, num_stages)`` of the tiled GEMM: row tiles of 16 to
    64 (a dot takes 16 rows at least; padding rows cost no weight bytes), 64 outputs where N allows,
    and K split (a divisor of the chunks, at most ``TILED_MAX_SPLIT``) to the number of programs
    nearest ``TILED_PROGRAMS_PER_SM`` an SM (by ratio): at decode sizes every program streams
    weights, too few leave bandwidth unused and too many add partial sums; four pipeline stages
    (loads of three chunks ahead in flight)."""
    _, chunk = tiled_n8_chunk(k, group_size)
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n = next(b for b in (64, 32, 16) if n % b == 0)
    programs = triton.cdiv(m, block_m) * (n // block_n)
    chunks = k // chunk
    target = TILED_PROGRAMS_PER_SM[block_m] * sm_count
    splits = [d for d in range(1, TILED_MAX_SPLIT + 1) if chunks % d == 0]
    split = min(splits, key=lambda d: abs(math.log(programs * d / target)))
    return block_m, block_n, split, 4, 4


def int4_gemm_n8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 perm: torch.Tensor | None, group_size: int, bias: torch.Tensor | None,
                 out: torch.Tensor | None = None, config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``x[:, perm] @ W^T (+ bias)`` by the tiled GEMM (``_int4_gemm_n8_kernel``) from a word-row
    weight; ``config``: ``tiled_n8_config``'s tuple (default its choice). Precondition:
    ``tiled_n8_fits``. Split K writes float32 partial sums, added by ``splitk.splitk_sum_kernel``."""
    m, k = x.shape
    n = qweight.shape[0] * PACK
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, split, num_warps, num_stages = config or tiled_n8_config(m, n, k, group_size, _sm_count(x))
    run, chunk = tiled_n8_chunk(k, group_size)
    if n % block_n or k % (chunk * split):
        raise ValueError(f"int4 tiled GEMM config {(block_m, block_n, split)}: block_n must divide N={n} and the "
                         f"splits the {k // chunk} chunks of K")
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    # Act-order: the permuted input as one small gather (inside the kernel the gathered tile would
    # load element by element and hold a pointer per element: registers spill at 64 rows).
    xp = x if perm is None else x.index_select(1, perm)
    _int4_gemm_n8_kernel[(triton.cdiv(m, block_m), n // block_n, split)](
        xp, qweight, scales, zeros, bias if bias is not None else out, target,
        m, n, k, group_size, k // split, xp.stride(0), scales.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n,
        RUN=run, CHUNK=chunk, CODE_BITS=CODE_BASES[x.dtype][0], CODE_BASE=CODE_BASES[x.dtype][1], num_warps=num_warps, num_stages=num_stages)
    if split > 1:
        _splitk_sum(target, bias, out)
    return out


def _sm_count(x: torch.Tensor) -> int:
    """The SM count of x's device (an H100's under the interpreter)."""
    if not x.is_cuda:
        return 132
    return num_sms(x.device.index if x.device.index is not None else torch.cuda.current_device())


def _splitk_sum(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out = partials.sum(0) (+ bias)`` in out's dtype (``partials`` float32 ``[split, M, N]``)."""
    split, m, n = partials.shape
    block = 1024
    splitk_sum_kernel[(triton.cdiv(m * n, block),)](partials, bias if bias is not None else out, out, m, n,
                                                     out.stride(0), SPLIT=split, HAS_BIAS=bias is not None,
                                                     BLOCK=block, num_warps=4, **launch_kwargs(out.device))


def _check_gemv_n8_config(n: int, k: int, group_size: int, config: GemvN8Config) -> None:
    """ValueError unless ``config`` suits a word-row weight of ``n`` outputs and ``k`` inputs: the
    layout's run, steps that divide K, word rows that divide N / 8."""
    num_warps, run, split, word_rows, *_ = config
    if run != n8_run(k, group_size) or k % (32 * num_warps * run * split) or (n // PACK) % word_rows:
        raise ValueError(f"int4 GEMV config {config}: the run must be the layout's ({n8_run(k, group_size)}), "
                         f"the steps must divide K={k} and the word rows N/8={n // PACK}")


def int4_gemv_n8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 perm: torch.Tensor | None, group_size: int, bias: torch.Tensor | None,
                 out: torch.Tensor | None = None, config: tuple | None = None) -> torch.Tensor:
    """``x[:, perm] @ W^T (+ bias)`` by the word-row GEMV (``_int4_gemv_n8_kernel``; up to
    ``GEMV_MAX_ROWS`` rows), under programmatic dependent launch where ``pagedllm/pdl.py`` has it on;
    ``config``: a ``GemvN8Config`` (or its leading fields; default ``gemv_n8_config``'s, without
    folded zero points for a float32 ``x``: they would cost it 11 bits)."""
    m, k = x.shape
    n = qweight.shape[0] * PACK
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if config:
        config = GemvN8Config(*config)
    else:
        config = gemv_n8_config(m, n, k, group_size, _sm_count(x))
        config = config._replace(fold_zero=config.fold_zero and x.dtype != torch.float32)
    _check_gemv_n8_config(n, k, group_size, config)
    num_warps, run, split, word_rows, fold_zero, hoist, joint_sum = config
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    # Act-order: x gathered in the kernel (a gather launch before it cost 4.5 us a GEMV on an H100).
    perm = perm.to(torch.int32).contiguous() if perm is not None else None
    _int4_gemv_n8_kernel[(m, n // PACK // word_rows, split)](
        x, qweight, scales, zeros, perm if perm is not None else qweight, bias if bias is not None else out, target,
        m, n, k, group_size, k // split, x.stride(0), scales.stride(0), out.stride(0), MAGIC,
        HAS_PERM=perm is not None, HAS_BIAS=bias is not None, SPLIT=split,
        THREADS=32 * num_warps, RUN=run, WORD_ROWS=word_rows, FOLD_ZERO=fold_zero, HOIST=hoist,
        JOINT_SUM=joint_sum, num_warps=num_warps, **launch_kwargs(x.device))
    if split > 1:
        _splitk_sum(target, bias, out)
    return out


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                perm: torch.Tensor | None, group_size: int, bias: torch.Tensor | None,
                out: torch.Tensor | None = None, config: tuple[int, ...] | None = None,
                layout: str = ROWS_LAYOUT) -> torch.Tensor:
    """``[M, N]`` in x's dtype (``out`` if given), by the kernel the layout and M pick (module doc);
    ``config``: the launch sizes of that kernel (``gemv_config``'s tuple for the row-layout GEMV,
    ``gemv_n8_config``'s for the word-row GEMV, ``tiled_n8_config``'s for the tiled GEMM; default
    theirs). Precondition: ``fits`` (and ``n8_layout_fits`` for the word-row layout)."""
    m, k = x.shape
    n = num_outputs(qweight, layout)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiled = layout == N8_LAYOUT and m <= TILED_MAX_ROWS and tiled_n8_fits(x, n, group_size)
    if layout == N8_LAYOUT and (m <= N8_GEMV_MAX_ROWS or (m <= GEMV_MAX_ROWS and not tiled)):
        return int4_gemv_n8(x, qweight, scales, zeros, perm, group_size, bias, out, config)
    if tiled:
        return int4_gemm_n8(x, qweight, scales, zeros, perm, group_size, bias, out, config)
    if layout == ROWS_LAYOUT and m <= GEMV_MAX_ROWS:
        common = (x, qweight, scales, zeros, perm if perm is not None else qweight, bias if bias is not None else out,
                  out, m, n, k, group_size, x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0))
        block_n, block_k, num_warps, word_tiles = config or gemv_config(m, n, k)
        _int4_gemv_kernel[(triton.cdiv(n, block_n),)](
            *common, HAS_PERM=perm is not None, HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(m),
            BLOCK_N=block_n, BLOCK_K=block_k, WORD_TILES=word_tiles and m == 1, num_warps=num_warps)
        return out
    return int4_dequant_matmul(x, qweight, scales, zeros, perm, group_size, bias, out, layout)


def int4_dequant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        perm: torch.Tensor | None, group_size: int, bias: torch.Tensor | None,
                        out: torch.Tensor | None = None, layout: str = ROWS_LAYOUT) -> torch.Tensor:
    """``x[:, perm] @ W^T (+ bias)``: W dequantized in x's dtype (``int4_dequantize``), then cuBLAS.
    W is written and read back (about twice a bf16 GEMM's bytes): at prefill sizes a small cost
    next to the GEMM, whose tiles reuse each weight across many rows."""
    if out is None:
        out = torch.empty(x.shape[0], num_outputs(qweight, layout), dtype=x.dtype, device=x.device)
    w = int4_dequantize(qweight, scales, zeros, group_size, x.dtype, layout)
    xp = x if perm is None else x.index_select(1, perm)
    torch.matmul(xp, w.t(), out=out)
    if bias is not None:
        out += bias
    return out
