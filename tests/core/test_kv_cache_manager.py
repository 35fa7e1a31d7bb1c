"""KVCacheManager: block hashing, prefix hits (capped), allocation, freeing order, stats."""

from __future__ import annotations

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager, hash_block_tokens, update_block_hashes
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def make_request(req_id: str, token_ids: list[int], **params) -> Request:
    return Request(req_id, token_ids, SamplingParams(max_tokens=16, **params), eos_token_id=None)


def compute(manager: KVCacheManager, request: Request, num_tokens: int | None = None) -> list[int]:
    """Admit a request the way the scheduler does: lookup, allocate, 'run', cache the blocks."""
    hits, num_hit = manager.get_computed_blocks(request)
    n = request.num_tokens - num_hit if num_tokens is None else num_tokens
    new_ids = manager.allocate_slots(request, n, hits, num_hit)
    assert new_ids is not None
    request.num_computed_tokens = num_hit + n
    manager.cache_blocks(request, request.num_computed_tokens)
    manager.check_integrity()
    return new_ids


def test_block_hashes_are_chained_and_extended_as_tokens_arrive():
    r = make_request("a", list(range(10)))
    assert update_block_hashes(r, 4) == [
        hash_block_tokens(None, (0, 1, 2, 3)),
        hash_block_tokens(hash_block_tokens(None, (0, 1, 2, 3)), (4, 5, 6, 7)),
    ]
    first_two = list(r.block_hashes)
    r.output_token_ids += [10, 11]
    r.all_token_ids += [10, 11]
    update_block_hashes(r, 4)
    assert r.block_hashes[:2] == first_two and len(r.block_hashes) == 3
    # Same block contents after a different prefix hash differently.
    other = make_request("b", [9, 9, 9, 9, 4, 5, 6, 7])
    assert update_block_hashes(other, 4)[1] != first_two[1]


def test_allocate_slots_allocates_whole_blocks_and_returns_only_new_ids():
    m = KVCacheManager(block_size=4, num_blocks=10)
    r = make_request("a", list(range(10)))
    assert m.allocate_slots(r, 6) == [0, 1]
    r.num_computed_tokens = 6
    assert m.allocate_slots(r, 2) == []  # 8 tokens still fit in 2 blocks
    r.num_computed_tokens = 8
    assert m.allocate_slots(r, 2) == [2]
    assert m.get_block_ids("a") == [0, 1, 2]
    m.check_integrity()


def test_allocate_slots_failure_changes_nothing():
    m = KVCacheManager(block_size=4, num_blocks=3)
    r = make_request("a", list(range(20)))
    assert m.allocate_slots(r, 20) is None
    assert m.get_block_ids("a") == [] and "a" not in m.req_to_blocks
    assert m.get_num_free_blocks() == 3
    m.check_integrity()


def test_two_requests_sharing_three_blocks_hit_48_tokens():
    m = KVCacheManager(block_size=16, num_blocks=20)
    prefix = list(range(1000, 1048))
    a = make_request("a", prefix + [1, 2, 3, 4, 5])
    compute(m, a)
    b = make_request("b", prefix + [7, 8, 9])
    blocks, num_hit = m.get_computed_blocks(b)
    assert num_hit == 48 and [blk.block_id for blk in blocks] == m.get_block_ids("a")[:3]
    compute(m, b)
    assert m.get_block_ids("b")[:3] == m.get_block_ids("a")[:3]
    assert all(blk.ref_cnt == 2 for blk in blocks)
    assert m.prefix_cache_queries == a.num_tokens + b.num_tokens
    assert m.prefix_cache_hits == 48


def test_full_prompt_hit_is_capped_at_num_tokens_minus_one():
    m = KVCacheManager(block_size=16, num_blocks=20)
    prompt = list(range(48))
    a = make_request("a", prompt)
    compute(m, a)
    m.free(a)
    same = make_request("b", prompt)
    _, num_hit = m.get_computed_blocks(same)
    assert num_hit == 32  # 47 tokens at most, rounded down to whole blocks
    longer = make_request("c", prompt + [5])
    _, num_hit = m.get_computed_blocks(longer)
    assert num_hit == 48


def test_hits_are_only_whole_computed_blocks():
    m = KVCacheManager(block_size=4, num_blocks=10)
    a = make_request("a", list(range(12)))
    compute(m, a, num_tokens=6)  # one full block computed, the second half-way
    b = make_request("b", list(range(12)))
    assert m.get_computed_blocks(b)[1] == 4


def test_prompt_logprobs_and_disabled_caching_skip_the_lookup():
    m = KVCacheManager(block_size=4, num_blocks=10)
    compute(m, make_request("a", list(range(9))))
    assert m.get_computed_blocks(make_request("b", list(range(9))))[1] == 8
    lp = make_request("c", list(range(9)), prompt_logprobs=1)
    assert m.get_computed_blocks(lp) == ([], 0)
    queries = m.prefix_cache_queries
    compute(m, lp)
    assert m.prefix_cache_queries == queries  # not a lookup

    off = KVCacheManager(block_size=4, num_blocks=10, enable_caching=False)
    compute(off, make_request("a", list(range(9))))
    assert off.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert not off.block_pool.cached_block_hash_to_block


def test_free_cached_blocks_count_as_available_but_hits_are_not_double_counted():
    m = KVCacheManager(block_size=4, num_blocks=4)
    a = make_request("a", list(range(16)))
    compute(m, a)
    m.free(a)
    assert m.get_num_free_blocks() == 4 and m.usage == 0.0
    # b hits all 4 free cached blocks (16 tokens) and needs a 5th: touching the hits leaves none.
    b = make_request("b", list(range(16)) + [99, 98, 97, 96])
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 16
    assert m.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit) is None
    m.check_integrity()
    # c hits 3 blocks and needs 1 new: the one remaining free block (evicting its hash).
    c = make_request("c", list(range(12)) + [50, 51, 52, 53])
    hits, num_hit = m.get_computed_blocks(c)
    assert num_hit == 12
    assert m.allocate_slots(c, 4, hits, num_hit) == [3]
    m.check_integrity()
    assert m.usage == 1.0


def test_free_releases_in_reverse_so_the_tail_is_evicted_first_and_is_idempotent():
    m = KVCacheManager(block_size=4, num_blocks=6)
    a = make_request("a", list(range(16)))
    compute(m, a)
    held = m.get_block_ids("a")
    m.free(a)
    m.free(a)
    m.check_integrity()
    queue = [b.block_id for b in m.block_pool.free_block_queue]
    assert queue[-4:] == held[::-1]
    # Allocating 3 fresh blocks uses the 2 never-used ones, then evicts a's last block, keeping
    # its prefix blocks cached.
    other = make_request("x", [7] * 12)
    m.allocate_slots(other, 12)
    assert m.get_computed_blocks(make_request("y", list(range(16)) + [1]))[1] == 12
    m.check_integrity()


def test_touching_a_shared_block_keeps_it_from_eviction():
    m = KVCacheManager(block_size=4, num_blocks=5)
    a = make_request("a", list(range(8)))
    compute(m, a)
    m.free(a)
    b = make_request("b", list(range(8)) + [1])
    compute(m, b)  # hits both of a's blocks
    hit_ids = m.get_block_ids("b")[:2]
    c = make_request("c", [9] * 8)
    assert m.allocate_slots(c, 8) is not None  # the 2 blocks left
    assert not set(m.get_block_ids("c")) & set(hit_ids)
    assert m.allocate_slots(make_request("d", [3] * 4), 4) is None
    m.check_integrity()


def test_bad_arguments():
    with pytest.raises(ValueError):
        KVCacheManager(block_size=0, num_blocks=4)
    with pytest.raises(ValueError):
        KVCacheManager(block_size=4, num_blocks=0)


# -- sliding window: blocks wholly outside a running request's window are given back ---------------

def decode_steps(manager: KVCacheManager, request: Request, num_steps: int) -> None:
    """Append and compute one token at a time, as decode steps do (allocate only at block edges)."""
    for _ in range(num_steps):
        token = 1000 + request.num_tokens
        request.output_token_ids.append(token)
        request.all_token_ids.append(token)
        if request.num_computed_tokens + 1 > len(manager.req_to_blocks[request.request_id]) * manager.block_size:
            assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        manager.cache_blocks(request, request.num_computed_tokens)
        manager.check_integrity()


def test_sliding_window_gives_back_blocks_wholly_outside_the_window():
    m = KVCacheManager(block_size=4, num_blocks=8, sliding_window=6)
    r = make_request("a", list(range(12)))
    compute(m, r)  # 12 tokens, 3 blocks; the next query (position 12) sees keys 7..12
    assert m.num_null_blocks["a"] == 0  # given back at the next allocation, not before
    decode_steps(m, r, 1)  # position 12 needs a 4th block: block 0 (keys 0..3) is outside 7..12
    assert m.num_null_blocks["a"] == 1 and m.get_block_ids("a")[0] == 0
    assert m.get_num_free_blocks() == 8 - 3
    decode_steps(m, r, 60)  # 73 tokens: far more than the pool holds without giving blocks back
    held = m.req_to_blocks["a"][m.num_null_blocks["a"]:]
    assert len(m.req_to_blocks["a"]) == 19 and len(held) <= 6 // 4 + 2
    assert m.get_num_free_blocks() == 8 - len(held)
    m.free(r)
    m.check_integrity()
    assert m.get_num_free_blocks() == 8 and not m.num_null_blocks


def test_given_back_blocks_stay_cached_for_other_requests():
    """A given-back full block keeps its hash: a new request with the same prefix hits it (and, as
    it starts inside that prefix's window, takes only the hits it can see)."""
    m = KVCacheManager(block_size=4, num_blocks=16, sliding_window=6)
    prompt = list(range(16))
    a = make_request("a", prompt)
    compute(m, a)
    decode_steps(m, a, 4)  # blocks 0..2 are given back (keys 0..11 are before the window 14..19)
    assert m.num_null_blocks["a"] == 2
    b = make_request("b", prompt + [99, 98])
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 16  # the whole prompt: the given-back blocks are still cached
    assert m.allocate_slots(b, 2, hits, num_hit) is not None
    # b's next query is at position 16, window 11..16: blocks 0 and 1 are not taken at all.
    assert m.num_null_blocks["b"] == 2 and m.req_to_blocks["b"][2:4] == hits[2:4]
    assert all(block.ref_cnt == 0 for block in hits[:2])
    m.check_integrity()
    m.free(a)
    m.free(b)
    m.check_integrity()
    assert m.get_num_free_blocks() == 16


def test_without_a_window_every_block_is_kept():
    m = KVCacheManager(block_size=4, num_blocks=40)
    r = make_request("a", list(range(12)))
    compute(m, r)
    decode_steps(m, r, 40)
    assert m.num_null_blocks["a"] == 0 and len(m.get_block_ids("a")) == 13
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(block_size=4, num_blocks=4, sliding_window=0)
