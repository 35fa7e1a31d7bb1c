"""Fused sampling on the GPU: one token per row from softmax(logits / T), reading the logits once.

A row of ``V`` logits is cut into chunks of ``CHUNK`` columns. ``_sample_chunk_stats_kernel``
(program per (row, chunk)) reads its chunk once, in the logits' own dtype, and stores the chunk's
maximum ``m`` of the scores ``x = logits * log2(e) / T``, its first argmax, and
``s = sum 2^(x - m)`` (one hardware ``ex2`` per column; greedy rows score with ``T = 1`` and only
their argmax is used).
``_sample_draw_kernel`` (program per row) then draws by inverting the distribution in three
levels, each with its own uniform from one Philox call on the row's seed:

1. a chunk, with probability ``s_c * 2^(m_c - max m) / total`` (cumulative sum over <= 64 chunks);
2. within the chosen chunk, re-read (``CHUNK`` columns, ``CHUNK * 2`` bytes for bf16): a group of
   ``GROUP`` columns, by its share of the chunk's mass;
3. a column of that group, by its share of the group's mass.

``P(column) = P(chunk) P(group | chunk) P(column | group)`` is exactly the column's softmax
probability; drawing each level with a fresh uniform (not the residual of one) keeps the error
of each level's fp32 comparison within ~2^-24 of its parent's mass for every bucket, so the whole
draw is within ~1e-5 total-variation distance of the exact distribution. Greedy rows take the
first maximum (argmax's tie rule).

Invariants: a row's draw depends only on its logits, temperature and seed (a seeded request draws
the same token whatever else is in the batch); a column of zero probability (``-inf`` logit, or
``2^(x - m)`` underflowing to 0) is never drawn. Cost: one read of [B, V] logits by
``B * ceil(V / CHUNK)`` programs, then per row one more read of one chunk: two launches; the draw
kernel can also store the ids straight into pinned host memory (``pagedllm/zero_copy.py``), sparing
the step a device->host copy. It replaced a Gumbel-max kernel (argmax of ``x`` plus Gumbel noise),
whose noise cost two ``lg2`` and a quarter Philox call per column: 78.6 us against ~25 us for the
read alone at 256 rows of 151,936 bf16 logits on an H200
(``benchmarks/results/h200-sampler-2026-11-22.json``).
"""

from __future__ import annotations

import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    import triton
    import triton.language as tl

    _LOG2E = tl.constexpr(1.4426950408889634)

    @triton.jit
    def _row_scale(temp_ptr, greedy_ptr, row, ALL_GREEDY: tl.constexpr):
        """``log2(e) / T`` for a random row, 1 for a greedy one (its scores are only compared)."""
        if ALL_GREEDY:
            return 1.0
        greedy = tl.load(greedy_ptr + row) != 0
        return tl.where(greedy, 1.0, _LOG2E / tl.load(temp_ptr + row))

    @triton.jit
    def _sample_chunk_stats_kernel(logits_ptr, stride_row, temp_ptr, greedy_ptr, max_ptr, sum_ptr, idx_ptr,
                                   vocab, num_chunks, CHUNK: tl.constexpr, ALL_GREEDY: tl.constexpr):
        """Program (row, c): max, first argmax and ``sum 2^(x - max)`` of the scores of columns
        ``[c * CHUNK, (c + 1) * CHUNK)``. ``ALL_GREEDY``: no sum; ``temp_ptr``/``greedy_ptr`` unread."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab, other=float("-inf"))
        x = x.to(tl.float32) * _row_scale(temp_ptr, greedy_ptr, row, ALL_GREEDY)
        top = tl.max(x, axis=0)
        stat = row * num_chunks + chunk
        tl.store(max_ptr + stat, top)
        tl.store(idx_ptr + stat, tl.min(tl.where(x == top, cols, vocab), axis=0))
        if not ALL_GREEDY:
            top_safe = tl.where(top == float("-inf"), 0.0, top)  # a chunk of -inf only: its sum is 0
            tl.store(sum_ptr + stat, tl.sum(tl.math.exp2(x - top_safe), axis=0))

    @triton.jit
    def _pick(weights, ids, u, fallback_id):
        """Inverse CDF over one level: the first ``ids`` entry whose cumulative weight exceeds
        ``u * total`` (``u`` in [0, 1)); where rounding leaves none, the last entry of positive
        weight; ``fallback_id`` if no weight is positive."""
        cum = tl.cumsum(weights, axis=0)
        total = tl.max(cum, axis=0)
        target = u * total
        first = tl.min(tl.where(cum > target, ids, 2147483647), axis=0)
        last_positive = tl.max(tl.where(weights > 0, ids, -1), axis=0)
        chosen = tl.where(first == 2147483647, last_positive, first)
        return tl.where(chosen < 0, fallback_id, chosen)

    @triton.jit
    def _uniform(word):
        """uint32 word -> float32 uniform in [0, 1) (its top 24 bits)."""
        return (word.to(tl.uint32, bitcast=True) >> 8).to(tl.float32) * 5.9604644775390625e-08

    @triton.jit
    def _sample_draw_kernel(logits_ptr, stride_row, temp_ptr, greedy_ptr, seed_ptr, max_ptr, sum_ptr, idx_ptr,
                            out_ptr, host_out_ptr, vocab, num_chunks, CHUNK: tl.constexpr, GROUP: tl.constexpr,
                            CHUNKS_PAD: tl.constexpr, ALL_GREEDY: tl.constexpr, TO_HOST: tl.constexpr):
        """Row ``row``'s token from its chunk stats (greedy: the first maximum; random: the three-level
        inverse-CDF draw of the module doc), stored to ``out`` and, ``TO_HOST``, to ``host_out``."""
        row = tl.program_id(0)
        c = tl.arange(0, CHUNKS_PAD)
        valid = c < num_chunks
        m = tl.load(max_ptr + row * num_chunks + c, mask=valid, other=float("-inf"))
        best = tl.load(idx_ptr + row * num_chunks + c, mask=valid, other=vocab)
        top = tl.max(m, axis=0)
        token = tl.min(tl.where(m == top, best, vocab), axis=0)  # the argmax: greedy rows keep it
        if not ALL_GREEDY:
            if tl.load(greedy_ptr + row) == 0:
                u1, u2, u3, _ = tl.randint4x(tl.load(seed_ptr + row), tl.zeros((1,), tl.int32))
                top_safe = tl.where(top == float("-inf"), 0.0, top)
                s = tl.load(sum_ptr + row * num_chunks + c, mask=valid, other=0.0)
                chunk = _pick(s * tl.math.exp2(m - top_safe), c, tl.sum(_uniform(u1), axis=0), -1)
                if chunk >= 0:
                    m_c = tl.sum(tl.where(c == chunk, m, 0.0), axis=0)
                    NUM_GROUPS: tl.constexpr = CHUNK // GROUP
                    g = tl.arange(0, NUM_GROUPS)
                    j = tl.arange(0, GROUP)
                    cols = chunk * CHUNK + g[:, None] * GROUP + j[None, :]
                    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab,
                                other=float("-inf"))
                    p = tl.math.exp2(x.to(tl.float32) * _row_scale(temp_ptr, greedy_ptr, row, False) - m_c)
                    group = _pick(tl.sum(p, axis=1), g, tl.sum(_uniform(u2), axis=0), 0)
                    in_group = tl.sum(tl.where(g[:, None] == group, p, 0.0), axis=0)
                    col = _pick(in_group, j, tl.sum(_uniform(u3), axis=0), 0)
                    token = chunk * CHUNK + group * GROUP + col
        token = token.to(tl.int64)
        tl.store(out_ptr + row, token)
        if TO_HOST:
            tl.store(host_out_ptr + row, token)


_CHUNK = 4096  # columns per stats program: a row of 152k logits is read by 38 programs in parallel
_GROUP = 64  # columns per group of the draw's second level (CHUNK // GROUP groups)
# Warps per program. H200, 151,936 columns: chunks of 2048/4096/8192 x 4/8 stats warps x 1/4 draw
# warps, 1-256 rows: 4096 / 4 / 4 is within 0.3 us of the best everywhere (256 random rows 32.2 us).
_STATS_WARPS = 4
_DRAW_WARPS = 4


def fused_available(logits: torch.Tensor) -> bool:
    return HAS_TRITON and logits.is_cuda


def categorical_sample(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                       seeds: torch.Tensor, host_out: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids [B] drawn from softmax(logits / T) per row (argmax on greedy rows).

    ``logits`` [B, V] (any float dtype, last dim contiguous), ``temperature`` float32 [B] (ignored
    on greedy rows), ``greedy`` bool [B], ``seeds`` int64 [B] (Philox seed per row). ``host_out``:
    an optional pinned int64 [B] that the ids are also stored into, by the kernel (zero copy; valid
    once the stream has passed this call)."""
    return _launch(logits, (temperature, greedy, seeds), host_out)


def greedy_argmax(logits: torch.Tensor, host_out: torch.Tensor | None = None) -> torch.Tensor:
    """``logits.argmax(-1)`` (ties: the lowest index) in the sampler's two launches. ``host_out`` as
    in ``categorical_sample``."""
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
    chunk_max = torch.empty((num_rows, num_chunks), dtype=torch.float32, device=logits.device)
    chunk_sum = torch.empty_like(chunk_max) if row_params is not None else chunk_max  # unused when greedy
    chunk_idx = torch.empty((num_rows, num_chunks), dtype=torch.int32, device=logits.device)
    temperature, greedy, seeds = row_params if row_params is not None else (logits, logits, logits)  # unread
    all_greedy = row_params is None
    _sample_chunk_stats_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), temperature, greedy, chunk_max, chunk_sum, chunk_idx, vocab, num_chunks,
        CHUNK=_CHUNK, ALL_GREEDY=all_greedy, num_warps=_STATS_WARPS)
    _sample_draw_kernel[(num_rows,)](
        logits, logits.stride(0), temperature, greedy, seeds, chunk_max, chunk_sum, chunk_idx, out,
        out if host_out is None else host_out, vocab, num_chunks, CHUNK=_CHUNK, GROUP=_GROUP,
        CHUNKS_PAD=triton.next_power_of_2(num_chunks), ALL_GREEDY=all_greedy, TO_HOST=host_out is not None,
        num_warps=_DRAW_WARPS)
    return out
