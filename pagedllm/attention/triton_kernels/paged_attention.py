"""Paged attention over the KV cache in Triton: one unified ragged kernel and a split-KV decode path.

Layout and semantics are those of ``pagedllm/attention/backend.py``: the cache is
``[2, num_blocks, block_size, num_kv_heads, head_dim]``; request ``r`` owns query rows
``query_start_loc[r]:query_start_loc[r+1]``, the last ``query_len`` of its ``seq_len`` tokens, and
query ``j`` attends causally to keys ``0 .. seq_len - query_len + j``.

Shared by both kernels (``_attend_range``): keys are visited in tiles of ``TILE_N`` positions; each
position looks up its physical block in the request's block table, so a tile may span several
pages and ``TILE_N`` does not depend on ``block_size``. Scores are computed in fp32 with
``tl.dot`` on operands in the cache's dtype (a float8 cache's tiles are upcast in registers to
float16 under a half-precision query, ``_compute_dtype``: exact, and the bytes read stay one an
element; the V tile by PTX, ``_upcast_v_tile`` says why), softmax is online (running max
``m`` and sum ``l`` in base 2, ``scale * log2(e)`` folded into the scores), and the output
accumulator is fp32.

GQA: a program serves all ``num_heads // num_kv_heads`` query heads of one KV head, so every K/V
tile is loaded once per group. The rows of the ``[BLOCK_M, head_dim]`` query tile are
``(query token, head in group)`` pairs: row ``i`` is token ``i // QPK_PAD``, head ``i % QPK_PAD``.

- ``unified_attention``: grid ``(num_tokens // BLOCK_Q + num_reqs, num_kv_heads)``. Program ``b``
  finds its request by binary search over ``query_start_loc`` (request ``r``'s q-blocks start at
  ``query_start_loc[r] // BLOCK_Q + r``, an upper bound that needs no host data) and handles
  ``BLOCK_Q`` query tokens of it; surplus programs exit at once (so do decodes with
  ``skip_decodes``, when ``paged_decode`` handles them). Decode, prefill and chunked
  prefill with a cached prefix are the same case. Cost: each program reads its request's K/V up
  to its last query's position once, so a long prompt re-reads K/V ``query_len / BLOCK_Q`` times
  (compute-bound there anyway).
- ``paged_decode``: the requests with ``query_len == 1`` (others exit at once). Grid
  ``(num_kv_heads, num_reqs, num_splits)``; split ``s`` attends over its share of the request's ``seq_len`` (read on the
  device), writing an unnormalised fp32 partial plus ``(m, l)``; ``_decode_reduce_kernel``
  (grid ``(num_reqs, num_heads)``) merges the splits. ``num_splits`` depends only on
  ``num_reqs``, ``num_kv_heads`` and the SM count, never on sequence lengths, so the decode path
  is CUDA-graph capturable for a fixed (padded) batch size. Cost: K/V read once; partials are
  ``num_reqs * num_heads * num_splits * head_dim`` fp32 words written and read once. (Merging in
  the split kernel instead, by the last split of each (request, KV head) to arrive at an atomic
  counter, measured no faster at batch 1 -- 1.4-2.1x slower in a first version, 2.9-3.3 us slower
  for Llama-8B's 4 query heads per KV head in a second -- and at most 1.8 us faster at batch 2-16
  for Qwen3-0.6B's heads; benchmarks/results/h200-decode-experiments-2026-11-21.json.)
  Load balance at large batch (one split, thousands of programs of ragged length): the GPU starts
  programs roughly in launch order, so an optional ``order`` (request indices, longest ``seq_len``
  first) makes the launch order longest-first and the last wave holds the shortest requests
  instead of whichever long request happens to come last (a tail in which most SMs idle).

Per-layer options, compile-time constants (``SLIDING_WINDOW = 0`` and ``SOFT_CAP = 0.0`` compile to
the code without them): a sliding window W starts each program's key loop at its first query's
first visible key ``q - W + 1`` (the keys and blocks before it are never loaded: a model whose every
layer slides may have given them back), the decode kernel splits only the window's keys (all
visible to its one query: no mask), and the unified kernel masks the window's edge tiles; a logit soft
cap c turns each score s into ``c * tanh(s / c)`` before the mask (the host passes ``scale / c``
in place of ``scale * log2(e)``).

Both decode kernels take ``USE_PDL`` (programmatic dependent launch, ``pagedllm/pdl.py``): the split
kernel reads only the step's metadata before its wait; the unified kernel does not use PDL.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedllm.pdl import launch_kwargs
from pagedllm.triton_pdl import allow_dependents, wait_for_inputs

_LOG2E = 1.4426950408889634
# Split-KV sizing: aim for this many programs per SM; never more splits than this; never a split
# shorter than this many keys (short contexts then leave trailing splits empty; they exit cheaply).
# 64 keys (one tile) per split: at batch 1-4 and 512-4096 keys the split + reduce pair takes
# 8.1-8.5 us instead of 9.4-9.9 us at 128 (H200, benchmarks/kernels/sweep_decode.py); from
# batch 16 up the two are within 1%.
_DECODE_PROGRAMS_PER_SM = 2
_MAX_SPLITS = 64
_MIN_SPLIT_LEN = 64


@triton.jit
def _attend_range(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    head_offset,
    kv_start,
    kv_end,
    scale_log2,
    stride_c_blk,
    stride_c_slot,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr = 0,
    SOFT_CAP: tl.constexpr = 0.0,
):
    """Online-softmax attention of ``q`` ([BLOCK_M, D]) over key positions [kv_start, kv_end).

    ``MASK``: 0 = every row sees every key of every tile (the caller guarantees whole tiles below
    the diagonal: no score masking at all), 1 = keys at or past ``kv_end`` are masked, 2 = that
    and causal: row ``i`` sees keys at positions ``<= q_pos[i]``, 3 = that and the sliding window:
    row ``i`` sees keys ``> q_pos[i] - SLIDING_WINDOW``. Every row must see at least one key overall
    (true for real rows), else its ``l`` stays 0 and the caller writes zeros. With ``SOFT_CAP`` c,
    ``scale_log2`` is ``scale / c`` and a score is ``c * log2(e) * tanh(q.k * scale / c)``.
    """
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    for tile_start in range(kv_start, kv_end, TILE_N):
        k_pos = tile_start + tl.arange(0, TILE_N)
        k_valid = k_pos < kv_end
        block = tl.load(block_table_ptr + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        kv_offs = block * stride_c_blk + (k_pos % BLOCK_SIZE) * stride_c_slot + head_offset
        k = tl.load(
            k_cache_ptr + kv_offs[None, :] + dims[:, None],
            mask=k_valid[None, :] & dim_valid[:, None],
            other=0.0,
        ).to(q.dtype)  # [D, TILE_N]; a float8 cache is upcast here (exact), else a no-op
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        if SOFT_CAP > 0:
            s = _tanh(s) * (SOFT_CAP * 1.4426950408889634)
        if MASK == 3:
            visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
            s = tl.where(k_valid[None, :] & visible, s, float("-inf"))
        elif MASK == 2:
            s = tl.where(k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        elif MASK == 1:
            s = tl.where(k_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: keep it at 0
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + kv_offs[:, None] + dims[None, :],
            mask=k_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        v = _upcast_v_tile(v, q.dtype)  # [TILE_N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# Whether the kernels may use inline PTX: not in Triton's interpreter (TRITON_INTERPRET=1, the CPU
# kernel tests), which runs none.
_PTX = tl.constexpr(not triton.knobs.runtime.interpret)


@triton.jit
def _upcast_v_tile(v, dtype: tl.constexpr):
    """A V tile ([TILE_N, D], as loaded from the cache) in ``dtype``, the dots' dtype.

    A float8 tile bound for float16 dots is converted by PTX (``cvt.rn.f16x2.e4m3x2`` /
    ``e5m2x2``: one instruction per pair of values) in a non-pure inline-asm op. A plain cast would
    be moved by Triton after the tile's shared-memory load into the dot's operand layout, and P @ V
    contracts over the keys, not V's contiguous dimension: for 8-bit values that load is a
    transpose byte by byte (one ``ld.shared.b8`` a value, 128 per thread per 64-key tile: the
    decode kernel issued 3944 SASS instructions against 2760 for bf16; this way 2368). On an H100
    (benchmarks/gpu/kv_fp8_decode_kernel.py, 256 requests) that took the fp8 / bf16 decode time
    from 0.73 to 0.66 at 1000 keys each, and left it at ~0.65 for 100-2048 keys: the kernel is
    bound by memory latency there (``decode_config``). Opaque, the conversion stays where it is written: the tile is
    read from shared memory in 4-16 byte vectors, converted in registers and staged as float16,
    which ``ldmatrix.trans`` transposes as it does a bf16 tile. The K tile needs none of this (its
    contiguous dimension is the contracted one). Other dtypes: a plain cast (a no-op for a cache
    in the dots' dtype)."""
    if _PTX and v.dtype == tl.float8e4nv and dtype == tl.float16:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [v.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4,
        )
    elif _PTX and v.dtype == tl.float8e5 and dtype == tl.float16:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e5m2x2 $0, lo; cvt.rn.f16x2.e5m2x2 $1, hi; }",
            "=r,=r,r", [v.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4,
        )
    else:
        return v.to(dtype)


@triton.jit
def _tanh(x):
    """tanh from one exp2 of a non-positive argument (no overflow): ``sign(x) (1 - e) / (1 + e)``,
    ``e = exp(-2 |x|)``."""
    e = tl.math.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """The last request ``r`` whose first q-block ``query_start_loc[r] // BLOCK_Q + r`` is <= q_block."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# ``num_reqs`` changes every step: not specialised (Triton would otherwise compile separate
# variants for 1, multiples of 16 and the rest, one of them in the middle of serving).
@triton.jit(do_not_specialize=["num_reqs"])
def _unified_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    num_reqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_bt,
    stride_c_blk,
    stride_c_slot,
    stride_c_head,
    QUERIES_PER_KV: tl.constexpr,
    QPK_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    SKIP_DECODES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr = 0,
    SOFT_CAP: tl.constexpr = 0.0,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + req)
    if q_block_local * BLOCK_Q >= q_len:  # surplus program of the upper-bound grid
        return
    if SKIP_DECODES:
        if q_len == 1:  # left to the split-KV decode kernel
            return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # keys already in the cache before this step's queries

    rows = tl.arange(0, BLOCK_M)
    q_local = q_block_local * BLOCK_Q + rows // QPK_PAD
    head_in_group = rows % QPK_PAD
    head = kv_head * QUERIES_PER_KV + head_in_group
    row_valid = (q_local < q_len) & (head_in_group < QUERIES_PER_KV)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q_rows = (q_start + q_local).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    ).to(COMPUTE_DTYPE)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    q_pos = context_len + q_local
    kv_end = context_len + tl.minimum((q_block_local + 1) * BLOCK_Q, q_len)  # last query's position + 1
    # Keys 0 .. first query's position are visible to every row: whole tiles there need no mask.
    unmasked_end = (context_len + q_block_local * BLOCK_Q + 1) // TILE_N * TILE_N
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    head_offset = kv_head * stride_c_head
    if SLIDING_WINDOW > 0:
        # From the first query's first visible key: [kv_lo, b_start) window-masked, then whole tiles
        # every row sees (from the last query's first visible key), then the causal tail.
        kv_lo = tl.maximum(context_len + q_block_local * BLOCK_Q - SLIDING_WINDOW + 1, 0)
        all_see = tl.cdiv(tl.maximum(kv_end - SLIDING_WINDOW, kv_lo), TILE_N) * TILE_N
        b_start = tl.maximum(tl.minimum(all_see, unmasked_end), kv_lo)
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, head_offset, kv_lo, b_start, scale_log2,
            stride_c_blk, stride_c_slot, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, TILE_N, 3, DOT_PRECISION,
            SLIDING_WINDOW, SOFT_CAP,
        )  # fmt: skip
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, head_offset, b_start, unmasked_end,
            scale_log2, stride_c_blk, stride_c_slot, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, TILE_N, 0, DOT_PRECISION,
            SLIDING_WINDOW, SOFT_CAP,
        )  # fmt: skip
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, head_offset,
            tl.maximum(unmasked_end, kv_lo), kv_end, scale_log2, stride_c_blk, stride_c_slot, BLOCK_SIZE,
            HEAD_DIM, HEAD_DIM_PAD, TILE_N, 3, DOT_PRECISION, SLIDING_WINDOW, SOFT_CAP,
        )  # fmt: skip
    else:
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, head_offset, 0, unmasked_end, scale_log2,
            stride_c_blk, stride_c_slot, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, TILE_N, 0, DOT_PRECISION,
            0, SOFT_CAP,
        )  # fmt: skip
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, head_offset, unmasked_end, kv_end, scale_log2,
            stride_c_blk, stride_c_slot, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, TILE_N, 2, DOT_PRECISION,
            0, SOFT_CAP,
        )  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


# ``num_splits`` is a runtime value (one compiled variant per head shape, whatever the batch size);
# only whether there is more than one split (``SPLIT``) is compiled in.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    out_ptr,
    order_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_bt,
    stride_c_blk,
    stride_c_slot,
    stride_c_head,
    num_splits,
    NUM_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    USE_PDL: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr = 0,
    SOFT_CAP: tl.constexpr = 0.0,
):
    kv_head = tl.program_id(0)  # fastest-varying: the heads of one request start together
    req = tl.program_id(1)
    split = tl.program_id(2)
    if HAS_ORDER:
        req = tl.load(order_ptr + req)
    # The three loads are issued together (seq_len before the early exit): one memory round trip
    # fewer on the latency-bound path at small batch.
    q_row = tl.load(query_start_loc_ptr + req)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    seq_len = tl.load(seq_lens_ptr + req)
    # The step's metadata above may be read before the PDL wait; q and the cache only after it.
    wait_for_inputs(USE_PDL)
    if q_end - q_row != 1:  # not a decode (or a padded request)
        return
    # The keys the query sees: the whole context, or its window's last SLIDING_WINDOW (never
    # loaded before that: those blocks may be gone). Every one of them is visible: no causal mask.
    kv_first = 0
    if SLIDING_WINDOW > 0:
        kv_first = tl.maximum(seq_len - SLIDING_WINDOW, 0)
    split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len - kv_first, num_splits), TILE_N) * TILE_N, MIN_SPLIT_LEN)
    kv_start = kv_first + split * split_len
    kv_end = tl.maximum(tl.minimum(kv_start + split_len, seq_len), kv_start)  # == kv_start: an empty split

    rows = tl.arange(0, BLOCK_M)
    head = kv_head * QUERIES_PER_KV + rows
    row_valid = rows < QUERIES_PER_KV
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q = tl.load(
        q_ptr + q_row.to(tl.int64) * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    ).to(COMPUTE_DTYPE)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Whole tiles first (no masks), then the sequence's partial last tile (bounds mask).
    unmasked_end = kv_start + (kv_end - kv_start) // TILE_N * TILE_N
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    head_offset = kv_head * stride_c_head
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, rows, k_cache_ptr, v_cache_ptr, bt_row, head_offset, kv_start, unmasked_end, scale_log2,
        stride_c_blk, stride_c_slot, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, TILE_N, 0, DOT_PRECISION, 0, SOFT_CAP,
    )  # fmt: skip
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, rows, k_cache_ptr, v_cache_ptr, bt_row, head_offset, unmasked_end, kv_end, scale_log2,
        stride_c_blk, stride_c_slot, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, TILE_N, 1, DOT_PRECISION, 0, SOFT_CAP,
    )  # fmt: skip
    allow_dependents(USE_PDL)
    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0 (padding) gives zeros
        tl.store(
            out_ptr + q_row.to(tl.int64) * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        part = (req.to(tl.int64) * NUM_HEADS + head) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    query_start_loc_ptr,
    stride_o_tok,
    stride_o_head,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    # The partials are loaded before the decode check (they are in bounds for every request; a
    # non-decode's are never stored), so their loads and query_start_loc's share one round trip.
    q_row = tl.load(query_start_loc_ptr + req)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    wait_for_inputs(USE_PDL)
    allow_dependents(USE_PDL)  # one short wave: the next kernel may be placed at once
    splits = tl.arange(0, MAX_SPLITS)
    valid = splits < num_splits
    part = (req.to(tl.int64) * NUM_HEADS + head) * num_splits + splits
    m = tl.load(part_m_ptr + part, mask=valid, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=valid, other=0.0)  # noqa: E741
    dims = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], mask=valid[:, None], other=0.0)
    if q_end - q_row != 1:
        return
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    total = tl.sum(l * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + q_row.to(tl.int64) * stride_o_tok + head * stride_o_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def _num_sms(device: torch.device) -> int:
    """Multiprocessor count (1 off CUDA, e.g. in Triton's interpreter)."""
    if device.type != "cuda":
        return 1
    return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=8)
def _cuda_num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_num_splits(num_reqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per request for split-KV decode: enough programs for ``_DECODE_PROGRAMS_PER_SM`` per
    SM, a power of two, at most ``_MAX_SPLITS``. Depends on no sequence length (graph-safe)."""
    programs = max(1, num_reqs * num_kv_heads)
    want = triton.cdiv(_DECODE_PROGRAMS_PER_SM * num_sms, programs)
    return 1 if want <= 1 else min(_MAX_SPLITS, triton.next_power_of_2(want))


# Launch configurations (tile_n, num_warps, num_stages) of the split-KV decode kernel. A float8 cache
# reads half the bytes a tile: to keep as many bytes in flight per SM (the kernel is bound by memory
# latency times the bytes it has in flight) its tiles are prefetched two deep (5 stages: the block
# table, then K/V, then the dots), in larger tiles when few programs run (split requests).
# benchmarks/gpu/kv_fp8_decode_kernel.py, H100.
_DECODE_CONFIG = (64, 2, 3)
_FP8_DECODE_CONFIG = (64, 2, 5)
_FP8_DECODE_SPLIT_CONFIG = (128, 4, 3)


def decode_config(cache_size: int, num_splits: int) -> tuple[int, int, int]:
    """The default ``(tile_n, num_warps, num_stages)`` of ``paged_decode`` for a cache of
    ``cache_size`` bytes an element cut into ``num_splits`` splits a request."""
    if cache_size != 1:
        return _DECODE_CONFIG
    return _FP8_DECODE_SPLIT_CONFIG if num_splits > 1 else _FP8_DECODE_CONFIG


_SMEM_BUDGET = 160 * 1024  # bytes of Q + pipelined K/V tiles we allow one program (H100: 227 KB)


def _fit_tiles(
    block_m: int, tile_n: int, num_stages: int, head_dim_pad: int, compute_size: int, cache_size: int
) -> tuple[int, int]:
    """Shrink pipelining depth, then the key tile, until Q plus ``num_stages`` K and V tiles fit in
    ``_SMEM_BUDGET`` (matters for fp32 caches and head_dim > 128). ``compute_size`` is the bytes of
    the dots' dtype (Q's tile), ``cache_size`` the cache's (the pipelined K/V tiles); a float8 cache
    also stages one V tile in the dots' dtype (``_upcast_v_tile``)."""

    def smem(tn: int, st: int) -> int:
        staged = tn * compute_size if cache_size < compute_size else 0
        return (block_m * compute_size + 2 * tn * st * cache_size + staged) * head_dim_pad

    while smem(tile_n, num_stages) > _SMEM_BUDGET and num_stages > 2:
        num_stages -= 1
    while smem(tile_n, num_stages) > _SMEM_BUDGET and tile_n > 16:
        tile_n //= 2
    return tile_n, num_stages


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _compute_dtype(query: torch.Tensor, kv_cache: torch.Tensor) -> torch.dtype:
    """The dtype of the dot products: the cache's; for a float8 cache (``kv_cache_dtype="fp8*"``,
    upcast tile by tile as it is loaded) float16 under a half-precision query, else the query's.
    Float8 -> float16 is one conversion instruction per pair of values on Hopper, -> bfloat16
    several: with bfloat16 the upcast, not the memory, bounded the decode kernel (1.2x faster than
    a bf16 cache instead of up to 2x; benchmarks/gpu/kv_fp8_decode_kernel.py). Both are exact for
    the float8 tile; a bfloat16 query loses nothing in float16 unless a component is outside
    float16's range (|q| > 65504, or below 6e-5 where it becomes subnormal)."""
    if kv_cache.element_size() != 1:
        return kv_cache.dtype
    return torch.float16 if query.dtype in (torch.bfloat16, torch.float16) else query.dtype


def _score_scale(scale: float, soft_cap: float | None) -> float:
    """What the kernels multiply ``q.k`` by: ``scale * log2(e)`` (base-2 softmax), or with a soft cap
    c ``scale / c`` (the cap's tanh comes next; ``_attend_range`` multiplies by ``c * log2(e)``)."""
    return scale * _LOG2E if soft_cap is None else scale / soft_cap


def _window_args(sliding_window: int | None, logits_soft_cap: float | None) -> dict:
    """The kernels' constexprs for a layer's options (0 / 0.0: off, the code without them)."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive or None, got {logits_soft_cap}")
    return {"SLIDING_WINDOW": int(sliding_window or 0), "SOFT_CAP": float(logits_soft_cap or 0.0)}


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 caches are for tests: exact dots


def _common(query: torch.Tensor, kv_cache: torch.Tensor):
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert query.stride(-1) == 1 and kv_cache.stride(-1) == 1
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    return num_heads, head_dim, num_kv_heads, num_heads // num_kv_heads, k_cache, v_cache


def unified_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    block_m: int | None = None,
    tile_n: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
    skip_decodes: bool = False,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """Attention for any ragged batch (decode, prefill, chunked prefill) in one launch; writes
    ``out[:query_start_loc[-1]]``, or with ``skip_decodes`` only the rows of requests with
    ``query_len > 1`` (pair it with ``paged_decode`` for the rest). ``max_query_len`` (a host int)
    only picks the tile height. ``sliding_window`` / ``logits_soft_cap``: the layer's (module doc).

    Defaults (``benchmarks/kernels/sweep_prefill.py``, H200, 16,384-token chunks of prompts of
    16-256, 100-1024 and 2048-4096 tokens, Qwen3-0.6B and Llama-3.1-8B heads): 64-row query tiles,
    32-key tiles, 2 stages are the best of 12 configurations or within 4% of it in all six cases,
    and 4-30% faster than 128-row tiles of 64 keys in 3 stages (short prompts gain the most)."""
    num_heads, head_dim, num_kv_heads, qpk, k_cache, v_cache = _common(query, kv_cache)
    compute_dtype = _compute_dtype(query, kv_cache)
    num_reqs = seq_lens.shape[0]
    qpk_pad = triton.next_power_of_2(qpk)
    if block_m is None:  # enough rows for the longest query, between 16 and 64
        block_m = min(64, max(16, triton.next_power_of_2(max_query_len * qpk_pad)))
    block_m = max(block_m, qpk_pad)
    block_q = block_m // qpk_pad
    head_dim_pad = triton.next_power_of_2(head_dim)
    tile_n, num_stages = _fit_tiles(block_m, tile_n, num_stages, head_dim_pad, compute_dtype.itemsize,
                                    kv_cache.element_size())
    grid = (query.shape[0] // block_q + num_reqs, num_kv_heads)
    _unified_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        _score_scale(scale, logits_soft_cap),
        num_reqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        QUERIES_PER_KV=qpk,
        QPK_PAD=qpk_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        SKIP_DECODES=skip_decodes,
        DOT_PRECISION=_dot_precision(compute_dtype),
        COMPUTE_DTYPE=_TL_DTYPES[compute_dtype],
        num_warps=num_warps,
        num_stages=num_stages,
        **_window_args(sliding_window, logits_soft_cap),
    )


def paged_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_split_len: int = _MIN_SPLIT_LEN,
    order: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """Split-KV decode of the requests with ``query_len == 1``; other requests are skipped (padded
    requests with ``query_len 0``, or prefills left to ``unified_attention(skip_decodes=True)``); a
    decode with ``seq_len 0`` (CUDA-graph padding) gives a zero row. No host sync, grid fixed by
    ``num_reqs``: CUDA-graph capturable. ``order`` (optional, int32 [num_reqs]) must be a
    permutation of ``0..num_reqs-1``: the order in which requests' programs are launched (longest
    first balances the load; see the module doc). It changes no result. ``sliding_window`` /
    ``logits_soft_cap``: the layer's (module doc); the splits then cover the window's keys only.
    ``tile_n`` / ``num_warps`` / ``num_stages``: the launch configuration, by default
    ``decode_config``'s."""
    num_heads, head_dim, num_kv_heads, qpk, k_cache, v_cache = _common(query, kv_cache)
    compute_dtype = _compute_dtype(query, kv_cache)
    num_reqs = seq_lens.shape[0]
    if num_splits is None:
        num_splits = decode_num_splits(num_reqs, num_kv_heads, _num_sms(query.device))
    assert 1 <= num_splits <= _MAX_SPLITS, f"num_splits must be in 1..{_MAX_SPLITS}"
    default = decode_config(kv_cache.element_size(), num_splits)
    tile_n, num_warps, num_stages = (given or d for given, d in zip((tile_n, num_warps, num_stages), default))
    head_dim_pad = triton.next_power_of_2(head_dim)
    block_m = max(16, triton.next_power_of_2(qpk))
    tile_n, num_stages = _fit_tiles(block_m, tile_n, num_stages, head_dim_pad, compute_dtype.itemsize,
                                    kv_cache.element_size())
    if num_splits > 1:
        rows = num_reqs * num_heads * num_splits
        part_acc = torch.empty(rows, head_dim_pad, dtype=torch.float32, device=query.device)
        part_m = torch.empty(rows, dtype=torch.float32, device=query.device)
        part_l = torch.empty(rows, dtype=torch.float32, device=query.device)
    else:
        part_acc = part_m = part_l = out  # unused
    _decode_split_kernel[(num_kv_heads, num_reqs, num_splits)](
        out,
        order if order is not None else seq_lens,  # unread without an order
        part_acc,
        part_m,
        part_l,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        _score_scale(scale, logits_soft_cap),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_splits,
        NUM_HEADS=num_heads,
        QUERIES_PER_KV=qpk,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_M=block_m,
        TILE_N=tile_n,
        SPLIT=num_splits > 1,
        MIN_SPLIT_LEN=max(min_split_len, tile_n),
        DOT_PRECISION=_dot_precision(compute_dtype),
        COMPUTE_DTYPE=_TL_DTYPES[compute_dtype],
        HAS_ORDER=order is not None,
        num_warps=num_warps,
        num_stages=num_stages,
        **_window_args(sliding_window, logits_soft_cap),
        **launch_kwargs(query.device),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_reqs, num_heads)](
            out,
            part_acc,
            part_m,
            part_l,
            query_start_loc,
            out.stride(0),
            out.stride(1),
            num_splits,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            MAX_SPLITS=_MAX_SPLITS,
            num_warps=4,
            **launch_kwargs(query.device),
        )
