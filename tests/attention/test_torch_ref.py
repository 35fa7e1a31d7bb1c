"""The CPU reference backend against a naive per-request attention, and its decode grouping plan."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedllm.attention import torch_ref
from pagedllm.attention.backend import CommonAttentionInputs
from pagedllm.attention.torch_ref import TorchRefBackend, plan_decode_groups


def _naive(q, k, v, q_pos, scale, window=None, soft_cap=None):
    """q ``[Lq, H, D]`` at positions ``q_pos``; k/v ``[L, Hkv, D]``: causal softmax attention (keys
    within ``window`` of the query; scores soft-capped)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    k_pos, q_pos = torch.arange(k.shape[0])[None, :], torch.tensor(q_pos)[:, None]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = scores.masked_fill(~visible, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def _batch(seq_lens, query_lens, num_heads=6, num_kv_heads=2, head_dim=16, block_size=4, seed=0):
    """A ragged batch over a shuffled paged cache; returns (q, k_new, v_new, cache, meta, full K/V)."""
    gen = torch.Generator().manual_seed(seed)
    nblk = [(s + block_size - 1) // block_size for s in seq_lens]
    total = sum(nblk) + 3
    perm = torch.randperm(total, generator=gen)
    tables = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32)
    used = 0
    for r, b in enumerate(nblk):
        tables[r, :b] = perm[used:used + b]
        used += b
    cache = torch.randn(2, total, block_size, num_kv_heads, head_dim, generator=gen)
    keys = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    for r, s in enumerate(seq_lens):  # the context before this step's queries is already cached
        for pos in range(s - query_lens[r]):
            slot = (int(tables[r, pos // block_size]), pos % block_size)
            cache[0, slot[0], slot[1]] = keys[r][pos]
            cache[1, slot[0], slot[1]] = values[r][pos]
    qsl = [0]
    slots, k_new, v_new = [], [], []
    for r, (s, ql) in enumerate(zip(seq_lens, query_lens)):
        qsl.append(qsl[-1] + ql)
        for pos in range(s - ql, s):
            slots.append(int(tables[r, pos // block_size]) * block_size + pos % block_size)
        k_new.append(keys[r][s - ql:])
        v_new.append(values[r][s - ql:])
    n = qsl[-1]
    meta = TorchRefBackend.metadata_builder.build(CommonAttentionInputs(
        num_actual_tokens=n, max_query_len=max(query_lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables, slot_mapping=torch.tensor(slots, dtype=torch.int64),
    ))
    q = torch.randn(n, num_heads, head_dim, generator=gen)
    return q, torch.cat(k_new), torch.cat(v_new), cache, meta, keys, values


@pytest.mark.parametrize("share", [0.0, 0.25, 1e9])
def test_backend_matches_naive_attention_on_a_ragged_batch(monkeypatch, share):
    """Decodes of very different lengths (several groups, or one per request at share 0, or one
    padded batch), a prefill, and a chunked prefill over a cached prefix, all in one step."""
    monkeypatch.setattr(torch_ref, "MAX_PADDING_SHARE", share)
    rng = random.Random(1)
    seq_lens = [rng.randint(1, 90) for _ in range(12)] + [17, 40]
    query_lens = [1] * 12 + [17, 9]
    q, k, v, cache, meta, keys, values = _batch(seq_lens, query_lens)
    scale = 0.25
    out = TorchRefBackend().forward(q, k, v, cache, meta, scale)
    qsl = meta.query_start_loc_cpu
    for r, (s, ql) in enumerate(zip(seq_lens, query_lens)):
        ref = _naive(q[qsl[r]:qsl[r + 1]], keys[r], values[r], list(range(s - ql, s)), scale)
        torch.testing.assert_close(out[qsl[r]:qsl[r + 1]], ref, rtol=1e-5, atol=1e-5)


def test_plan_covers_every_decode_once_and_bounds_padding():
    rng = random.Random(0)
    lens = [rng.randint(1, 500) for _ in range(64)]
    tables = torch.arange(64 * 32, dtype=torch.int32).view(64, 32)
    plan = plan_decode_groups(lens, list(range(100, 164)), tables, 16, torch.device("cpu"))
    rows = sorted(int(x) for g in plan.groups for x in g.rows)
    assert rows == list(range(100, 164))
    for g in plan.groups:
        members = [int(x) - 100 for x in g.rows]
        real = sum(lens[i] for i in members)
        assert g.max_len == max(lens[i] for i in members)
        assert len(members) == 1 or g.max_len * len(members) <= (1 + torch_ref.MAX_PADDING_SHARE) * real
        assert g.num_blocks == (g.max_len + 15) // 16
        assert g.blocks.tolist() == tables[members, :g.num_blocks].flatten().tolist()
        assert g.mask.shape == (len(members), 1, 1, g.max_len)
        assert (g.mask == 0).sum().item() == real and bool((g.mask[g.mask != 0] == float("-inf")).all())
    assert 1 < len(plan.groups) < 64  # grouped, but not one call per request


def test_backend_plans_once_per_step():
    """The grouping is computed at the step's first layer and reused while the metadata is the same."""
    q, k, v, cache, meta, _, _ = _batch([5, 30, 31, 8], [1, 1, 1, 1])
    backend = TorchRefBackend()
    backend.forward(q, k, v, cache, meta, 0.25)
    plan = backend._plans[None]
    backend.forward(q, k, v, cache.clone(), meta, 0.25)
    assert backend._plans[None] is plan
    q2, k2, v2, cache2, meta2, _, _ = _batch([5, 30], [1, 1])
    backend.forward(q2, k2, v2, cache2, meta2, 0.25)
    assert backend._plans[None] is not plan


def test_reference_backend_refuses_pre_stored_kv():
    """The CPU reference stores K/V itself; a caller claiming it already did is a bug, not a no-op."""
    q, k, v, cache, meta, _, _ = _batch([5, 9], [1, 1])
    assert not TorchRefBackend().accepts_stored_kv and TorchRefBackend.kv_writer is None
    with pytest.raises(ValueError, match="stores K/V itself"):
        TorchRefBackend().forward(q, k, v, cache, meta, 0.25, kv_stored=True)


@pytest.mark.parametrize("window,soft_cap", [(5, None), (1, None), (13, 2.5), (None, 0.7)])
def test_sliding_window_and_soft_cap_match_naive_attention(window, soft_cap):
    """Decodes far past the window, inside it, prefills and chunks longer than it. The blocks wholly
    before every query's window (a sliding model may have given them back) are replaced by blocks
    of NaN that nothing else points at: they must never be read."""
    rng = random.Random(2)
    seq_lens = [rng.randint(1, 60) for _ in range(8)] + [23, 40, 9]
    query_lens = [1] * 8 + [23, 11, 9]
    q, k, v, cache, meta, keys, values = _batch(seq_lens, query_lens, seed=3)
    block_size = cache.shape[2]
    if window is not None:
        gone = [(r, b) for r, (s, ql) in enumerate(zip(seq_lens, query_lens))
                for b in range(max(0, s - ql - window + 1) // block_size)]
        poison = torch.full((2, len(gone), *cache.shape[2:]), float("nan"))
        for i, (r, b) in enumerate(gone):
            meta.block_tables[r, b] = cache.shape[1] + i
        cache = torch.cat([cache, poison], dim=1)
    out = TorchRefBackend().forward(q, k, v, cache, meta, 0.25, sliding_window=window, logits_soft_cap=soft_cap)
    qsl = meta.query_start_loc_cpu
    for r, (s, ql) in enumerate(zip(seq_lens, query_lens)):
        ref = _naive(q[qsl[r]:qsl[r + 1]], keys[r], values[r], list(range(s - ql, s)), 0.25, window, soft_cap)
        torch.testing.assert_close(out[qsl[r]:qsl[r + 1]], ref, rtol=1e-5, atol=1e-5)
