"""The fused-MoE grouped GEMM: every expert's tokens in two launches (the published fused-MoE design).

An *assignment* is one (token, slot) pair of the router's top-k, numbered ``token * top_k + slot``.
``align_assignments`` groups the assignments by expert and pads each expert's run to a multiple of
``block_m`` (padding rows hold the sentinel ``T * top_k``), so that every block of ``block_m``
sorted rows belongs to one expert (``block_expert``). ``_moe_gemm_kernel`` then computes, per block
of rows and block of output columns, ``A[rows] @ W[expert]^T`` reading only that expert's weight:

1. gate_up: ``A`` = the tokens (row ``assignment // top_k``), ``W = w13``; the gate and up columns
   are two accumulators of the same program and the epilogue writes ``silu(gate) * up`` ``[T*k, I]``;
2. down: ``A`` = that activation (row ``assignment``), ``W = w2``; the epilogue multiplies by the
   routing weight and writes row ``assignment`` of ``[T*k, H]``;

and the caller sums the top-k rows of each token.

At decode of a few tokens (``fused_experts_direct``: a handful of assignments, few of them sharing an
expert) sorting and padding cost more launches than the GEMMs: ``_moe_gemv_kernel`` then takes one
program per (assignment, column block), reads the expert id straight from the router's ``topk_ids``
and streams that expert's weight rows as a GEMV (no tensor cores, no padding rows); an expert chosen
by two tokens is read twice (from L2 when it is warm). Rounding as the torch path (``fused_moe.grouped_experts``):
gate and up rounded to the input dtype before the float32 SiLU, its result rounded, the product
rounded; the down product rounded before the float32 weight multiply. Under expert parallel the
assignments to another rank's experts get no rows (and their output rows stay zero).

Everything is sized from host shapes (the grid from the worst-case padded length ``T*k +
min(E, T*k) * (block_m - 1)``, blocks past the real padded length exit at once), with no host sync:
the whole path is capturable in a CUDA graph. Cost: the weights of the experts that received
tokens are read once per column block of rows (``block_m`` rows share each weight tile), plus
``T*k*(I + H)`` activations written and read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, first_expert, num_experts):
    # One program per assignment: count it on its (local) expert.
    expert = tl.load(ids_ptr + tl.program_id(0)).to(tl.int32) - first_expert
    if (expert >= 0) & (expert < num_experts):
        tl.atomic_add(counts_ptr + expert, 1)


@triton.jit
def _offsets_kernel(counts_ptr, cursor_ptr, block_expert_ptr, num_padded_ptr, num_experts, num_blocks,
                    BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, BLOCKS: tl.constexpr):
    # One program: each expert's run padded to BLOCK_M rows, runs back to back in expert order;
    # ``cursor`` = each run's first row (the scatter's next free row), and each block's expert.
    experts = tl.arange(0, EXPERTS)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + experts, ends - padded, mask=experts < num_experts)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    for first in range(0, num_blocks, BLOCKS):
        blocks = first + tl.arange(0, BLOCKS)
        # block b belongs to the first expert whose run ends after row b * BLOCK_M
        ended = (ends[None, :] <= blocks[:, None] * BLOCK_M) & (experts[None, :] < num_experts)
        tl.store(block_expert_ptr + blocks, tl.sum(ended.to(tl.int32), 1), mask=blocks < num_blocks)


@triton.jit
def _scatter_kernel(ids_ptr, cursor_ptr, sorted_ids_ptr, first_expert, num_experts):
    # One program per assignment: take the next free row of its expert's run.
    assignment = tl.program_id(0)
    expert = tl.load(ids_ptr + assignment).to(tl.int32) - first_expert
    if (expert >= 0) & (expert < num_experts):
        row = tl.atomic_add(cursor_ptr + expert, 1)
        tl.store(sorted_ids_ptr + row, assignment)


def align_assignments(topk_ids: torch.Tensor, num_local_experts: int, first_expert: int,
                      block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_ids [R] int32, block_expert [R / block_m] int32, num_padded [1] int32)`` for the
    router's ``topk_ids [T, k]``: the assignments to local experts ``first_expert ..`` grouped by
    expert (in expert order; within an expert's run in any order: every row is computed on its own),
    each expert's run padded to a multiple of ``block_m`` with the sentinel ``T*k``; ``num_padded``
    rows of the ``R`` (the host-known worst case) are in use, and block ``b`` of them belongs to
    expert ``block_expert[b]`` (beyond ``num_padded``: unspecified). Five launches (two fills, a
    count, the offsets, a scatter), each assignment one atomic add in the count and one in the scatter."""
    device = topk_ids.device
    n, experts = topk_ids.numel(), num_local_experts
    ids = topk_ids.reshape(-1)
    rows = triton.cdiv(n + min(experts, n) * (block_m - 1), block_m) * block_m
    num_blocks = rows // block_m
    counts = torch.zeros(experts, dtype=torch.int32, device=device)
    sorted_ids = torch.full((rows,), n, dtype=torch.int32, device=device)
    cursor = torch.empty(experts, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    _count_kernel[(n,)](ids, counts, first_expert, experts)
    _offsets_kernel[(1,)](counts, cursor, block_expert, num_padded, experts, num_blocks, BLOCK_M=block_m,
                          EXPERTS=triton.next_power_of_2(experts), BLOCKS=max(16, 4096 // triton.next_power_of_2(experts)))
    _scatter_kernel[(n,)](ids, cursor, sorted_ids, first_expert, experts)
    return sorted_ids, block_expert, num_padded


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, c_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
                     N, K, num_assignments, a_row_divisor, num_row_blocks,
                     stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_cm, stride_cn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     SILU_AND_MUL: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Grouped order of (row block, column block) programs: GROUP_M row blocks share column tiles in L2.
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * col_blocks
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_row_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    assignment = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = assignment < num_assignments
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = (assignment // a_row_divisor).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if SILU_AND_MUL:  # the up rows sit N rows below the gate rows of the same expert
            w_up = tl.load(w_ptrs + N * stride_wn, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    io_dtype = c_ptr.dtype.element_ty
    out = acc.to(io_dtype).to(tl.float32)
    if SILU_AND_MUL:
        up = acc_up.to(io_dtype).to(tl.float32)
        out = (out / (1.0 + tl.exp(-out))).to(io_dtype).to(tl.float32) * up
    if MUL_WEIGHT:
        routed = tl.load(weights_ptr + assignment, mask=row_mask, other=0.0)
        out = out * routed[:, None]
    c_ptrs = c_ptr + assignment[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, out.to(io_dtype), mask=row_mask[:, None] & col_mask[None, :])


def _moe_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, aligned: tuple,
              a_row_divisor: int, silu_and_mul: bool, config: tuple[int, ...]) -> None:
    sorted_ids, block_expert, num_padded = aligned
    block_m, block_n, block_k, group_m, num_warps, num_stages = config
    n = out.shape[1]
    k = a.shape[1]
    row_blocks = sorted_ids.numel() // block_m
    grid = (row_blocks * triton.cdiv(n, block_n),)
    _moe_gemm_kernel[grid](
        a, w, out, weights, sorted_ids, block_expert, num_padded,
        n, k, out.shape[0], a_row_divisor, row_blocks,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        SILU_AND_MUL=silu_and_mul, MUL_WEIGHT=not silu_and_mul,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )


@triton.jit
def _moe_gemv_kernel(a_ptr, w_ptr, c_ptr, weights_ptr, ids_ptr, N, K, a_row_divisor, first_expert, num_local,
                     stride_am, stride_we, stride_wn, stride_cm,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SILU_AND_MUL: tl.constexpr, MUL_WEIGHT: tl.constexpr):
    # One program: assignment ``pid0`` (a row of ``c``), columns ``pid1 * BLOCK_N ..`` of it.
    assignment = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    io_dtype = c_ptr.dtype.element_ty
    expert = tl.load(ids_ptr + assignment).to(tl.int64) - first_expert
    c_ptrs = c_ptr + assignment.to(tl.int64) * stride_cm + cols
    if (expert < 0) | (expert >= num_local):  # another expert-parallel rank's expert
        tl.store(c_ptrs, tl.zeros((BLOCK_N,), dtype=io_dtype), mask=col_mask)
        return
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (assignment // a_row_divisor).to(tl.int64) * stride_am + offs_k
    w_ptrs = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        if SILU_AND_MUL:  # the up rows sit N rows below the gate rows of the same expert
            w_up = tl.load(w_ptrs + N * stride_wn, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
            acc_up += tl.sum(w_up.to(tl.float32) * a[None, :], axis=1)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = acc.to(io_dtype).to(tl.float32)
    if SILU_AND_MUL:
        up = acc_up.to(io_dtype).to(tl.float32)
        out = (out / (1.0 + tl.exp(-out))).to(io_dtype).to(tl.float32) * up
    if MUL_WEIGHT:
        out = out * tl.load(weights_ptr + assignment)
    tl.store(c_ptrs, out.to(io_dtype), mask=col_mask)


def _moe_gemv(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              a_row_divisor: int, first_expert: int, silu_and_mul: bool, config: tuple[int, int, int]) -> None:
    block_n, block_k, num_warps = config
    n, k = out.shape[1], a.shape[1]
    _moe_gemv_kernel[(out.shape[0], triton.cdiv(n, block_n))](
        a, w, out, weights, ids, n, k, a_row_divisor, first_expert, w.shape[0],
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, SILU_AND_MUL=silu_and_mul, MUL_WEIGHT=not silu_and_mul,
        num_warps=num_warps,
    )


def fused_experts_direct(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, first_expert: int, config: tuple[int, int, int]) -> torch.Tensor:
    """``fused_experts`` for a few tokens without sorting (module doc): two GEMV launches over the
    assignments plus the top-k sum. ``config``: ``(block_n, block_k, num_warps)``. Same arguments,
    result and rounding as ``fused_experts``; the weights must be contiguous in their last dim."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(num_tokens * top_k, w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    _moe_gemv(x, w13, act, weights, ids, top_k, first_expert, True, config)
    rows = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _moe_gemv(act, w2, rows, weights, ids, 1, first_expert, False, config)
    return rows.view(num_tokens, top_k, hidden).sum(dim=1)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, first_expert: int, expert_parallel: bool,
                  config: tuple[int, int, int, int, int, int]) -> torch.Tensor:
    """``FusedMoE``'s experts for ``x [T, H]`` (contiguous rows): ``w13 [E, 2I, H]``, ``w2 [E, H,
    I]`` of local experts ``first_expert ..``; ``topk_weights`` float32 and ``topk_ids`` ``[T, k]``;
    ``expert_parallel``: some assignments may go to another rank's experts (their rows are zeroed).
    ``config``: ``(block_m, block_n, block_k, group_m, num_warps, num_stages)``."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    intermediate = w13.shape[1] // 2
    num_assignments = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x if x.stride(1) == 1 else x.contiguous()
    aligned = align_assignments(topk_ids, w13.shape[0], first_expert, config[0])
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(num_assignments, intermediate, dtype=x.dtype, device=x.device)
    _moe_gemm(x, w13, act, weights, aligned, top_k, True, config)
    rows = (torch.zeros if expert_parallel else torch.empty)(num_assignments, hidden, dtype=x.dtype, device=x.device)
    _moe_gemm(act, w2, rows, weights, aligned, 1, False, config)
    return rows.view(num_tokens, top_k, hidden).sum(dim=1)
