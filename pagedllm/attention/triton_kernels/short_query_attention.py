"""Split-KV attention for requests of a few queries each (speculative verification, short chunks).

A verify step gives a request ``1 + k`` queries over its whole context. The unified kernel
(``paged_attention.unified_attention``) gives each (request, KV head) one program that walks every
key alone: at batch 1 that is ``num_kv_heads`` programs on the whole GPU, one key tile after the
other. Here, as in ``paged_decode``, the keys of each (request, KV head) are cut into
``num_splits`` ranges (``paged_attention.decode_num_splits``: enough programs for the GPU, a
count fixed by the batch size alone, so the launch is CUDA-graph capturable), and a reduce kernel
merges the partial softmaxes.

Program ``(kv_head, req, split)`` serves every query of a request with ``2 <= query_len`` (decodes
are ``paged_decode``'s; padding requests have none): the rows of its ``[BLOCK_M, head_dim]`` query
tile are ``(query token, head in group)`` pairs, row ``i`` token ``i // QPK_PAD``, so
``BLOCK_M >= max_query_len * QPK_PAD`` (``fits``). Query ``j`` sits at position
``seq_len - query_len + j`` and sees the keys up to it: whole tiles below the first query's
position need no mask, the rest are masked causally (``paged_attention._attend_range``). A split
whose keys no query of a row sees leaves that row's partial at ``m = -inf, l = 0`` (weight 0 in the
reduce). Cost: K/V read once per (request, KV head); partials ``num_tokens * num_heads * num_splits *
head_dim`` fp32 words written and read once (none with one split).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.triton_kernels.paged_attention import (
    _MAX_SPLITS,
    _MIN_SPLIT_LEN,
    _TL_DTYPES,
    _attend_range,
    _common,
    _compute_dtype,
    _dot_precision,
    _fit_tiles,
    _num_sms,
    _score_scale,
    _window_args,
    decode_num_splits,
)

# Rows of one program's query tile at most (query tokens times padded heads per KV head).
MAX_ROWS = 64


def fits(max_query_len: int, queries_per_kv: int) -> bool:
    """Whether a batch whose longest query is ``max_query_len`` tokens fits one tile per request."""
    return max_query_len * triton.next_power_of_2(queries_per_kv) <= MAX_ROWS


@triton.jit(do_not_specialize=["num_splits"])
def _short_split_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
    seq_lens_ptr, query_start_loc_ptr, scale_log2, stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_bt, stride_c_blk, stride_c_slot, stride_c_head, num_splits,
    NUM_HEADS: tl.constexpr, QUERIES_PER_KV: tl.constexpr, QPK_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    SPLIT: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr, DOT_PRECISION: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr = 0, SOFT_CAP: tl.constexpr = 0.0,
):
    kv_head = tl.program_id(0)
    req = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    if q_len < 2:  # a decode (paged_decode's) or a padded request
        return
    context_len = seq_len - q_len
    rows = tl.arange(0, BLOCK_M)
    tok = rows // QPK_PAD
    head_in_group = rows % QPK_PAD
    head = kv_head * QUERIES_PER_KV + head_in_group
    row_valid = (tok < q_len) & (head_in_group < QUERIES_PER_KV)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0).to(COMPUTE_DTYPE)
    q_pos = context_len + tok
    # The keys some query sees: from the first query's first visible key to the last query.
    kv_first = 0
    if SLIDING_WINDOW > 0:
        kv_first = tl.maximum(context_len - SLIDING_WINDOW + 1, 0)
    split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len - kv_first, num_splits), TILE_N) * TILE_N, MIN_SPLIT_LEN)
    kv_start = kv_first + split * split_len
    kv_end = tl.maximum(tl.minimum(kv_start + split_len, seq_len), kv_start)  # == kv_start: an empty split
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    head_offset = kv_head * stride_c_head
    if SLIDING_WINDOW > 0:  # every tile masked (causal and window)
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, head_offset, kv_start, kv_end, scale_log2,
            stride_c_blk, stride_c_slot, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, TILE_N, 3, DOT_PRECISION,
            SLIDING_WINDOW, SOFT_CAP,
        )  # fmt: skip
    else:
        # Keys up to the first query's position (context_len) are visible to every row.
        whole = tl.maximum(tl.minimum(kv_end, context_len + 1) - kv_start, 0) // TILE_N * TILE_N
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, head_offset, kv_start, kv_start + whole,
            scale_log2, stride_c_blk, stride_c_slot, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, TILE_N, 0, DOT_PRECISION,
            0, SOFT_CAP,
        )  # fmt: skip
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, head_offset, kv_start + whole, kv_end,
            scale_log2, stride_c_blk, stride_c_slot, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, TILE_N, 2, DOT_PRECISION,
            0, SOFT_CAP,
        )  # fmt: skip
    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
    else:
        part = (q_rows * NUM_HEADS + head) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _short_reduce_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, query_start_loc_ptr, stride_o_tok, stride_o_head, num_splits,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MAX_SPLITS: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    j = tl.program_id(2)  # the request's j-th query
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if (q_len < 2) | (j >= q_len):
        return
    tok = (q_start + j).to(tl.int64)
    splits = tl.arange(0, MAX_SPLITS)
    valid = splits < num_splits
    part = (tok * NUM_HEADS + head) * num_splits + splits
    m = tl.load(part_m_ptr + part, mask=valid, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=valid, other=0.0)  # noqa: E741
    dims = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], mask=valid[:, None], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)  # splits the row sees nothing of (m = -inf) weigh 0
    total = tl.sum(l * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + tok * stride_o_tok + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def short_query_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    num_splits: int | None = None,
    tile_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """Attention of the requests with ``2 <= query_len <= max_query_len`` (module doc; ``fits`` must
    hold); other rows of ``out`` are left alone. No host sync; the grid depends on ``num_reqs`` and
    ``max_query_len`` only: CUDA-graph capturable."""
    num_heads, head_dim, num_kv_heads, qpk, k_cache, v_cache = _common(query, kv_cache)
    assert fits(max_query_len, qpk), f"max_query_len {max_query_len} with {qpk} heads per KV head exceeds a tile"
    compute_dtype = _compute_dtype(query, kv_cache)
    num_reqs = seq_lens.shape[0]
    if num_splits is None:
        num_splits = decode_num_splits(num_reqs, num_kv_heads, _num_sms(query.device))
    assert 1 <= num_splits <= _MAX_SPLITS, f"num_splits must be in 1..{_MAX_SPLITS}"
    qpk_pad = triton.next_power_of_2(qpk)
    block_m = max(16, triton.next_power_of_2(max_query_len * qpk_pad))
    head_dim_pad = triton.next_power_of_2(head_dim)
    tile_n, num_stages = _fit_tiles(block_m, tile_n, num_stages, head_dim_pad, compute_dtype.itemsize,
                                    kv_cache.element_size())
    if num_splits > 1:
        rows = query.shape[0] * num_heads * num_splits
        part_acc = torch.empty(rows, head_dim_pad, dtype=torch.float32, device=query.device)
        part_m = torch.empty(rows, dtype=torch.float32, device=query.device)
        part_l = torch.empty(rows, dtype=torch.float32, device=query.device)
    else:
        part_acc = part_m = part_l = out  # unused
    _short_split_kernel[(num_kv_heads, num_reqs, num_splits)](
        out, part_acc, part_m, part_l, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        _score_scale(scale, logits_soft_cap), query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), num_splits,
        NUM_HEADS=num_heads, QUERIES_PER_KV=qpk, QPK_PAD=qpk_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_M=block_m, TILE_N=tile_n, SPLIT=num_splits > 1,
        MIN_SPLIT_LEN=max(_MIN_SPLIT_LEN, tile_n), DOT_PRECISION=_dot_precision(compute_dtype),
        COMPUTE_DTYPE=_TL_DTYPES[compute_dtype], num_warps=num_warps, num_stages=num_stages,
        **_window_args(sliding_window, logits_soft_cap),
    )
    if num_splits > 1:
        _short_reduce_kernel[(num_reqs, num_heads, max_query_len)](
            out, part_acc, part_m, part_l, query_start_loc, out.stride(0), out.stride(1), num_splits,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, MAX_SPLITS=_MAX_SPLITS, num_warps=4,
        )
