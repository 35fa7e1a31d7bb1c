"""Fused sampling on the GPU: temperature + Gumbel-max draw in one pass over the logits.

For row r: ``argmax_v(logits[r, v] / T_r + G[r, v])`` with ``G = -log(-log U)``, ``U`` uniform
from Philox(seed_r, v), is an exact draw from ``softmax(logits[r] / T_r)`` (the Gumbel-max
trick) — no softmax, no normalisation, no materialised noise: one read of the logits. Greedy
rows skip the noise. Used when no row needs a top-k / top-p / min-p mask (those need the sorted
distribution; the torch path handles them).

Each row's noise depends only on its seed, so a seeded request draws the same token whatever
else is in the batch. Cost: one read of [B, V] logits in their own dtype (upcast in registers), by
``B * ceil(V / 4096)`` programs (a row is split so that small batches still fill the GPU), then a
tiny per-row reduce of the chunk winners: two launches.
"""

from __future__ import annotations

import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gumbel_chunk_kernel(logits_ptr, stride_row, temp_ptr, greedy_ptr, seed_ptr, best_val_ptr, best_idx_ptr,
                             vocab, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row, c): the best (score, index) of columns [c * CHUNK, (c + 1) * CHUNK)."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        inv_t = 1.0 / tl.load(temp_ptr + row)
        greedy = tl.load(greedy_ptr + row) != 0
        seed = tl.load(seed_ptr + row)
        best_val = tl.full((BLOCK,), float("-inf"), tl.float32)
        best_idx = tl.zeros((BLOCK,), tl.int32)
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab
            x = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            if not greedy:
                u = tl.rand(seed, cols)
                u = tl.maximum(u, 1e-20)
                x = x * inv_t - tl.log(-tl.log(u))
            better = x > best_val
            best_val = tl.where(better, x, best_val)
            best_idx = tl.where(better, cols, best_idx)
        top = tl.max(best_val, axis=0)
        # Lowest index among the maxima (argmax's tie rule).
        cand = tl.where(best_val == top, best_idx, vocab)
        tl.store(best_val_ptr + row * num_chunks + chunk, top)
        tl.store(best_idx_ptr + row * num_chunks + chunk, tl.min(cand, axis=0))

    @triton.jit
    def _gumbel_reduce_kernel(best_val_ptr, best_idx_ptr, out_ptr, vocab, num_chunks, CHUNKS_PAD: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, CHUNKS_PAD)
        valid = c < num_chunks
        val = tl.load(best_val_ptr + row * num_chunks + c, mask=valid, other=float("-inf"))
        idx = tl.load(best_idx_ptr + row * num_chunks + c, mask=valid, other=vocab)
        top = tl.max(val, axis=0)
        cand = tl.where(val == top, idx, vocab)
        tl.store(out_ptr + row, tl.min(cand, axis=0).to(tl.int64))


_CHUNK = 4096  # columns per program: a row of 152k logits is read by 38 programs in parallel


def fused_available(logits: torch.Tensor) -> bool:
    return HAS_TRITON and logits.is_cuda


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                  seeds: torch.Tensor) -> torch.Tensor:
    """Token ids [B] drawn from softmax(logits / T) per row (argmax on greedy rows).

    ``logits`` [B, V] (any float dtype, last dim contiguous), ``temperature`` float32 [B] (ignored
    on greedy rows), ``greedy`` bool [B], ``seeds`` int64 [B] (Philox seed per row)."""
    num_rows, vocab = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    assert logits.stride(-1) == 1
    num_chunks = triton.cdiv(vocab, _CHUNK)
    best_val = torch.empty((num_rows, num_chunks), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((num_rows, num_chunks), dtype=torch.int32, device=logits.device)
    _gumbel_chunk_kernel[(num_rows, num_chunks)](logits, logits.stride(0), temperature, greedy, seeds, best_val,
                                                 best_idx, vocab, num_chunks, CHUNK=_CHUNK, BLOCK=1024, num_warps=4)
    _gumbel_reduce_kernel[(num_rows,)](best_val, best_idx, out, vocab, num_chunks,
                                       CHUNKS_PAD=triton.next_power_of_2(num_chunks), num_warps=1)
    return out
