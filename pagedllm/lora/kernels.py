"""Triton SGMV kernels for batched LoRA (CUDA; the interpreter runs them in the tests).

Both kernels take the step's ``LoRABatchMapping``: program axis 1 is an active adapter group, axis 0
a tile of its tokens (rows gathered through ``sorted_token_ids``) times a tile of output columns;
a program past its group's last token returns at once. So one launch serves every adapter of the
step, and the grid's extent follows the largest group (in a CUDA graph: the graph's token count
and ``max_loras`` groups, ``mapping.GraphMapping``, whatever the step writes into them). A merged
layer (qkv: 3 slices, gate_up: 2) is one shrink and one expand over all its slices at once.

- shrink: ``shrunk[t, :] += x[t, :] @ A[s]^T`` into a zeroed float32 ``[T, R]`` buffer (the
  caller's, e.g. a view of the step's workspace, or a fresh one), with split-K: each program sums a
  K range and adds it atomically. R is small, so the K loop is the whole work; the split count
  (runtime: no compiled variant) gives a decode step enough programs to stream A at full speed.
- expand: ``y[t, :] += shrunk[t, :] @ B[s]^T`` in place (B's dtype on the tensor cores, float32
  accumulation, one rounding into ``y``); each token is in one group, so its rows of ``y`` have one
  writer. A program's token tile is up to 64 rows, which it runs 16 at a time (a decode group of
  a few tokens costs one 16-row pass, not a mostly masked 64-row tile). B of a merged layer is
  block-diagonal (``layers.py``): output row ``n`` reads only the rank columns of its own slice,
  and a tile loops over those of its rows' slices only (one slice but where a tile straddles
  two), not over the zero blocks of the others.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.lora.mapping import LoRABatchMapping

# Launch shapes (module attributes so that benchmarks/gpu/lora_profile.py can sweep them): the
# shrink's split-K aims at about SHRINK_PROGRAMS programs (one wave on an H100's 132 SMs), each
# summing at least SHRINK_MIN_K_BLOCKS blocks of 64 along K; its token tiles are 16 rows up to
# groups of SMALL_GROUP_MAX tokens, else 64, or, up to groups of SHRINK_ROW_LOOP_MAX tokens (0:
# never), a program runs all of a group's rows 16 at a time (0: the H100 sweep found it 0.8 us a
# layer faster at decode, but the decode graphs would then no longer compile the 64-row variant
# that a prefill's shrink takes, so the first long prefill would compile it while serving). The expand's tiles are EXPAND_BLOCK_N
# output columns wide and up to EXPAND_ROW_LOOP_MAX rows high, run 16 rows at a time. Programs have
# SHRINK_WARPS / EXPAND_WARPS warps. Defaults: the fastest of benchmarks/gpu/lora_profile.py's
# sweep at a 64-token decode of Llama-3.1-8B's layers (8 groups) on an H100.
SHRINK_PROGRAMS = 128
SHRINK_MIN_K_BLOCKS = 2
EXPAND_BLOCK_N = 128
SMALL_GROUP_MAX = 16
SHRINK_WARPS = 4
EXPAND_WARPS = 4
EXPAND_ROW_LOOP_MAX = 64
SHRINK_ROW_LOOP_MAX = 0
_MAX_SLICES = 3  # qkv


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, token_ids_ptr, starts_ptr, slots_ptr, K, R, k_per_split, split_k,
                   rows_per_program, stride_xm, stride_as, stride_ar, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_N: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    group = tl.program_id(1)
    pid_k = pid % split_k
    pid_n = (pid // split_k) % NUM_N
    pid_m = pid // (split_k * NUM_N)
    start = tl.load(starts_ptr + group)
    end = tl.load(starts_ptr + group + 1)
    row0 = start + pid_m * rows_per_program
    if row0 >= end:
        return
    row_end = tl.minimum(row0 + rows_per_program, end)
    slot = tl.load(slots_ptr + group).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = pid_k * k_per_split
    for m0 in range(row0, row_end, BLOCK_M):  # the program's rows, BLOCK_M at a time
        rows = m0 + tl.arange(0, BLOCK_M)
        tokens = tl.load(token_ids_ptr + rows, mask=rows < row_end, other=0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + tokens[:, None] * stride_xm + offs_k[None, :],
                        mask=(rows[:, None] < row_end) & (offs_k[None, :] < K), other=0.0)
            a = tl.load(a_ptr + slot * stride_as + offs_n[None, :] * stride_ar + offs_k[:, None],
                        mask=(offs_n[None, :] < R) & (offs_k[:, None] < K), other=0.0)
            acc += tl.dot(x, a.to(x.dtype), input_precision=DOT_PRECISION)
        mask = (rows[:, None] < row_end) & (offs_n[None, :] < R)
        tl.atomic_add(out_ptr + tokens[:, None] * stride_om + offs_n[None, :], acc, mask=mask)


@triton.jit
def _slice_of(n, slice1, slice2):
    return (n >= slice1).to(tl.int32) + (n >= slice2).to(tl.int32)


@triton.jit
def _expand_kernel(s_ptr, b_ptr, y_ptr, token_ids_ptr, starts_ptr, slots_ptr, N, R, slice1, slice2, slice_rank,
                   rows_per_program, stride_sm, stride_bs, stride_bn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, NUM_N: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    group = tl.program_id(1)
    pid_n = pid % NUM_N
    pid_m = pid // NUM_N
    start = tl.load(starts_ptr + group)
    end = tl.load(starts_ptr + group + 1)
    row0 = start + pid_m * rows_per_program
    if row0 >= end:
        return
    row_end = tl.minimum(row0 + rows_per_program, end)
    slot = tl.load(slots_ptr + group).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    # Row n reads only its slice's rank columns; the tile loops over those of its rows' slices.
    first_col = _slice_of(offs_n, slice1, slice2) * slice_rank
    r_lo = _slice_of(n0, slice1, slice2) * slice_rank
    r_hi = tl.minimum((_slice_of(tl.minimum(n0 + BLOCK_N, N) - 1, slice1, slice2) + 1) * slice_rank, R)
    for m0 in range(row0, row_end, BLOCK_M):  # the program's rows, BLOCK_M at a time
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        tokens = tl.load(token_ids_ptr + rows, mask=row_mask, other=0)
        delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(r_lo, r_hi, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            s = tl.load(s_ptr + tokens[:, None] * stride_sm + offs_r[None, :],
                        mask=row_mask[:, None] & (offs_r[None, :] < r_hi), other=0.0)
            in_slice = (offs_r[:, None] >= first_col[None, :]) & (offs_r[:, None] < first_col[None, :] + slice_rank)
            b = tl.load(b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
                        mask=(offs_n[None, :] < N) & in_slice, other=0.0)
            delta += tl.dot(s.to(b.dtype), b, input_precision=DOT_PRECISION)
        mask = row_mask[:, None] & (offs_n[None, :] < N)
        y = y_ptr + tokens[:, None] * stride_ym + offs_n[None, :]
        acc = tl.load(y, mask=mask, other=0.0).to(tl.float32) + delta
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 weights are for exactness (tests against PEFT): full-precision products, not TF32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_m(max_group_size: int) -> int:
    # The shrink's two tile heights only, so that the decode graphs' captures compile every
    # variant that eager steps use (nothing compiles while serving).
    return 16 if max_group_size <= SMALL_GROUP_MAX else 64


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRABatchMapping,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t, :] += x[t] @ A[s]^T`` for each token ``t`` of slot ``s``; returns ``out``.

    ``out``: a zeroed float32 ``[T, R]`` (rows may be strided, columns unit-stride); None: a fresh
    zeroed one (rows of tokens without an adapter stay 0)."""
    num_tokens, k = x.shape
    r = lora_a.shape[1]
    if out is None:
        out = torch.zeros(num_tokens, r, dtype=torch.float32, device=x.device)
    block_n, block_k = max(16, min(64, triton.next_power_of_2(r))), 64
    num_n = triton.cdiv(r, block_n)
    if mapping.max_group_size <= SHRINK_ROW_LOOP_MAX:  # one program per group, 16 rows at a time
        block_m, rows_per_program = 16, triton.cdiv(mapping.max_group_size, 16) * 16
    else:
        block_m = rows_per_program = _block_m(mapping.max_group_size)
    # Few token tiles (decode): split K so that enough programs stream A (at least two K blocks
    # each); many: the token tiles are the parallelism, no split.
    num_m = triton.cdiv(mapping.max_group_size, rows_per_program)
    tiles = num_m * num_n * mapping.num_groups
    split_k = max(1, min(triton.cdiv(SHRINK_PROGRAMS, tiles), triton.cdiv(k, SHRINK_MIN_K_BLOCKS * block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    grid = (num_m * num_n * split_k, mapping.num_groups)
    _shrink_kernel[grid](x, lora_a, out, mapping.sorted_token_ids, mapping.starts_dev, mapping.active_slots_dev,
                         k, r, k_per_split, split_k, rows_per_program, x.stride(0), lora_a.stride(0),
                         lora_a.stride(1), out.stride(0),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_N=num_n,
                         DOT_PRECISION=_dot_precision(x.dtype), num_warps=SHRINK_WARPS)
    return out


def lora_expand_(y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, mapping: LoRABatchMapping,
                 slice_starts: tuple[int, ...] = (0,), slice_rank: int | None = None) -> torch.Tensor:
    """``y[t] += shrunk[t] @ B[s]^T`` for the tokens of each group, in place; returns ``y``.

    ``slice_starts``: the first output row of each slice (at most 3, increasing from 0); slice
    ``i``'s rows read only B's columns ``i * slice_rank ... (i + 1) * slice_rank`` (default: one
    slice, every column)."""
    n, r = lora_b.shape[1], lora_b.shape[2]
    assert 1 <= len(slice_starts) <= _MAX_SLICES and slice_starts[0] == 0
    slice_rank = r if slice_rank is None else slice_rank
    bounds = [*slice_starts[1:], n, n][:2]  # first rows of slices 1 and 2 (n: no such slice)
    block_n, block_r = EXPAND_BLOCK_N, max(16, min(64, triton.next_power_of_2(slice_rank)))
    num_n = triton.cdiv(n, block_n)
    # A program covers up to EXPAND_ROW_LOOP_MAX rows of a group, 16 at a time: in a decode graph
    # (whose groups may hold all its tokens, but most hold a few) one program per output tile and
    # group, with no program exiting idle and no 64-row tile mostly masked; one compiled variant.
    rows_per_program = min(triton.cdiv(mapping.max_group_size, 16) * 16, EXPAND_ROW_LOOP_MAX)
    block_m = 16
    grid = (triton.cdiv(mapping.max_group_size, rows_per_program) * num_n, mapping.num_groups)
    _expand_kernel[grid](shrunk, lora_b, y, mapping.sorted_token_ids, mapping.starts_dev, mapping.active_slots_dev,
                         n, r, bounds[0], bounds[1], slice_rank, rows_per_program, shrunk.stride(0),
                         lora_b.stride(0), lora_b.stride(1), y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                         BLOCK_R=block_r, NUM_N=num_n, DOT_PRECISION=_dot_precision(lora_b.dtype),
                         num_warps=EXPAND_WARPS)
    return y


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    mapping: LoRABatchMapping, slice_starts: tuple[int, ...] = (0,), slice_rank: int | None = None,
                    shrunk: torch.Tensor | None = None) -> torch.Tensor:
    """``punica.add_lora`` on CUDA: one shrink and one expand launch. Needs unit-stride rows."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    assert y.stride(-1) == 1 and lora_a.stride(-1) == 1 and lora_b.stride(-1) == 1
    shrunk = lora_shrink(x, lora_a, mapping, shrunk)
    return lora_expand_(y, shrunk, lora_b, mapping, slice_starts, slice_rank)
