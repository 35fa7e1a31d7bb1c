"""Fused sampling on the GPU: temperature + Gumbel-max draw in one pass over the logits.

For row r: ``argmax_v(logits[r, v] / T_r + G[r, v])`` with ``G = -log(-log U)``, ``U`` uniform
from Philox(seed_r, v), is an exact draw from ``softmax(logits[r] / T_r)`` (the Gumbel-max
trick) — no softmax, no normalisation, no materialised noise: one read of the logits. Greedy
rows skip the noise. Used when no row needs a top-k / top-p / min-p mask (those need the sorted
distribution; the torch path handles them).

Each row's noise depends only on its seed, so a seeded request draws the same token whatever
else is in the batch. Cost: one read of [B, V] logits in their own dtype (upcast in registers), by
``B * ceil(V / 4096)`` programs (a row is split so that small batches still fill the GPU), then a
tiny per-row reduce of the chunk winners: two launches (the reduce can also store the ids straight
into pinned host memory, sparing the step a device->host copy). The noise, not the read, bounds the first:
one Philox call serves four columns (``randint4x``) and each column takes two hardware ``lg2``
approximations (``_gumbel_log2``), not two accurate ``logf`` calls (about 25 instructions each).

Scores are compared in base-2 units, ``logits * log2(e) / T - log2(E)`` with ``E = -ln U`` an
Exp(1) draw: that is ``log2(e)`` times the natural-log score minus a constant, so the argmax is
the same. ``E`` keeps its relative precision where it matters: the winning draws have small ``E``
(``U`` near 1), where ``E`` comes from a series in ``1 - U`` built from the integer draw, not from
the logarithm of a float that has rounded ``U`` to 24 bits.
"""

from __future__ import annotations

import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    _LOG2E = tl.constexpr(1.4426950408889634)
    _LN2 = tl.constexpr(0.6931471805599453)

    @triton.jit
    def _gumbel_log2(r):
        """``log2(E)`` for the Exp(1) draw ``E = -ln(1 - a)``, ``a = (r + 1/2) / 2^32`` uniform in (0, 1),
        from the uint32 word ``r``. Below ``a = 1/16``, ``-ln(1 - a)`` is its series to ``a^7`` (relative
        error < a^7/8); above, it is ``-ln2 * lg2(b)`` with ``b = 1 - a`` formed from ``~r`` as
        precisely as ``a`` (``lg2.approx``: absolute error ~2^-22.6, so ``E >= 0.064`` is within ~2e-6
        relative). The returned ``log2(E)`` is within ~3e-6 absolute."""
        r = r.to(tl.uint32, bitcast=True)
        a = (r.to(tl.float32) + 0.5) * 2.3283064365386963e-10
        b = ((~r).to(tl.float32) + 0.5) * 2.3283064365386963e-10
        series = a * (1.0 + a * (0.5 + a * (1.0 / 3 + a * (0.25 + a * (0.2 + a * (1.0 / 6 + a * (1.0 / 7)))))))
        e = tl.where(a < 0.0625, series, -_LN2 * libdevice.fast_log2f(b))
        return libdevice.fast_log2f(e)

    @triton.jit
    def _scores(row_ptr, cols, vocab, inv_t_log2e, r, NOISE: tl.constexpr):
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        if NOISE:
            x = x * inv_t_log2e - _gumbel_log2(r)
        return x

    @triton.jit
    def _chunk_best(row_ptr, first_col, vocab, inv_t_log2e, seed, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                    NOISE: tl.constexpr):
        """Per lane, the best score and its column over columns [first_col, first_col + CHUNK).

        A block of ``BLOCK`` columns is four quarters; one Philox call (``randint4x``) gives a
        column of each quarter its word: column ``start + j * QUARTER + i`` draws word ``j`` of
        counter ``start // 4 + i``, its own (counter, word) pair, for a quarter of the Philox work
        of one call per column. A lane visits its columns in increasing order and keeps the first
        of equal scores. ``inv_t_log2e`` is ``log2(e) / T`` (scores in base-2 units)."""
        QUARTER: tl.constexpr = BLOCK // 4
        lane = tl.arange(0, QUARTER)
        best_val = tl.full((QUARTER,), float("-inf"), tl.float32)
        best_idx = tl.zeros((QUARTER,), tl.int32)
        for start in range(first_col, first_col + CHUNK, BLOCK):
            r0, r1, r2, r3 = best_idx, best_idx, best_idx, best_idx  # unused without noise
            if NOISE:
                r0, r1, r2, r3 = tl.randint4x(seed, start // 4 + lane)
            for j in tl.static_range(4):
                cols = start + j * QUARTER + lane
                r = r0 if j == 0 else (r1 if j == 1 else (r2 if j == 2 else r3))
                x = _scores(row_ptr, cols, vocab, inv_t_log2e, r, NOISE)
                better = x > best_val
                best_val = tl.where(better, x, best_val)
                best_idx = tl.where(better, cols, best_idx)
        return best_val, best_idx

    @triton.jit
    def _gumbel_chunk_kernel(logits_ptr, stride_row, temp_ptr, greedy_ptr, seed_ptr, best_val_ptr, best_idx_ptr,
                             vocab, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                             ALL_GREEDY: tl.constexpr):
        """Program (row, c): the best (score, index) of columns [c * CHUNK, (c + 1) * CHUNK).
        ``ALL_GREEDY``: a plain argmax; ``temp_ptr``, ``greedy_ptr`` and ``seed_ptr`` are not read."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        if ALL_GREEDY:
            best_val, best_idx = _chunk_best(row_ptr, chunk * CHUNK, vocab, 1.0, 0, CHUNK, BLOCK, False)
        else:
            inv_t_log2e = _LOG2E / tl.load(temp_ptr + row)
            seed = tl.load(seed_ptr + row)
            if tl.load(greedy_ptr + row) != 0:
                best_val, best_idx = _chunk_best(row_ptr, chunk * CHUNK, vocab, inv_t_log2e, seed, CHUNK, BLOCK, False)
            else:
                best_val, best_idx = _chunk_best(row_ptr, chunk * CHUNK, vocab, inv_t_log2e, seed, CHUNK, BLOCK, True)
        top = tl.max(best_val, axis=0)
        # Lowest index among the maxima (argmax's tie rule).
        cand = tl.where(best_val == top, best_idx, vocab)
        tl.store(best_val_ptr + row * num_chunks + chunk, top)
        tl.store(best_idx_ptr + row * num_chunks + chunk, tl.min(cand, axis=0))

    @triton.jit
    def _gumbel_reduce_kernel(best_val_ptr, best_idx_ptr, out_ptr, host_out_ptr, vocab, num_chunks,
                              CHUNKS_PAD: tl.constexpr, TO_HOST: tl.constexpr):
        """Row ``row``'s winner over its chunks, stored to ``out`` and, ``TO_HOST``, to the pinned
        ``host_out`` too (a zero-copy store: ``pagedllm/zero_copy.py``)."""
        row = tl.program_id(0)
        c = tl.arange(0, CHUNKS_PAD)
        valid = c < num_chunks
        val = tl.load(best_val_ptr + row * num_chunks + c, mask=valid, other=float("-inf"))
        idx = tl.load(best_idx_ptr + row * num_chunks + c, mask=valid, other=vocab)
        top = tl.max(val, axis=0)
        cand = tl.where(val == top, idx, vocab)
        token = tl.min(cand, axis=0).to(tl.int64)
        tl.store(out_ptr + row, token)
        if TO_HOST:
            tl.store(host_out_ptr + row, token)


_CHUNK = 4096  # columns per program: a row of 152k logits is read by 38 programs in parallel


def fused_available(logits: torch.Tensor) -> bool:
    return HAS_TRITON and logits.is_cuda


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                  seeds: torch.Tensor, host_out: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids [B] drawn from softmax(logits / T) per row (argmax on greedy rows).

    ``logits`` [B, V] (any float dtype, last dim contiguous), ``temperature`` float32 [B] (ignored
    on greedy rows), ``greedy`` bool [B], ``seeds`` int64 [B] (Philox seed per row). ``host_out``:
    an optional pinned int64 [B] that the ids are also stored into, by the kernel (zero copy; valid
    once the stream has passed this call)."""
    return _launch(logits, (temperature, greedy, seeds), host_out)


def greedy_argmax(logits: torch.Tensor, host_out: torch.Tensor | None = None) -> torch.Tensor:
    """``logits.argmax(-1)`` (ties: the lowest index) in the sampler's two launches. One row of
    151,936 bf16 logits on an H200: 3.1-3.5 us + 1.2 us, where torch's argmax took 8.5 us after a
    0.8 us memset (``benchmarks/gpu/timeline_decode.py``). ``host_out`` as in ``gumbel_argmax``."""
    return _launch(logits, None, host_out)


def _launch(logits: torch.Tensor, row_params: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
            host_out: torch.Tensor | None) -> torch.Tensor:
    num_rows, vocab = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    assert host_out is None or (host_out.dtype == torch.int64 and host_out.shape == (num_rows,))
    assert logits.stride(-1) == 1
    num_chunks = triton.cdiv(vocab, _CHUNK)
    best_val = torch.empty((num_rows, num_chunks), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((num_rows, num_chunks), dtype=torch.int32, device=logits.device)
    temperature, greedy, seeds = row_params if row_params is not None else (logits, logits, logits)  # unread
    _gumbel_chunk_kernel[(num_rows, num_chunks)](logits, logits.stride(0), temperature, greedy, seeds, best_val,
                                                 best_idx, vocab, num_chunks, CHUNK=_CHUNK, BLOCK=1024,
                                                 ALL_GREEDY=row_params is None, num_warps=4)
    _gumbel_reduce_kernel[(num_rows,)](best_val, best_idx, out, out if host_out is None else host_out, vocab,
                                       num_chunks, CHUNKS_PAD=triton.next_power_of_2(num_chunks),
                                       TO_HOST=host_out is not None, num_warps=1)
    return out
