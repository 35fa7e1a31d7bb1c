"""BlockPool and FreeKVCacheBlockQueue: ref counts, LRU order, prefix-cache map, integrity."""

from __future__ import annotations

import random

import pytest

from pagedllm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# -- FreeKVCacheBlockQueue ---------------------------------------------------------------------


def test_free_queue_popleft_append_remove_keep_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert len(q) == 5 and ids(q) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])  # middle
    q.remove(blocks[0])  # head
    q.remove(blocks[4])  # tail
    assert ids(q) == [1, 3] and len(q) == 2
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    q.append(blocks[4])
    q.append(blocks[0])
    assert ids(q) == [1, 3, 4, 0]
    assert q.popleft() is blocks[1]
    assert ids(q) == [3, 4, 0] and len(q) == 3


def test_free_queue_rejects_double_insert_and_foreign_remove():
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError):
        q.append(blocks[0])
    q.remove(blocks[0])
    with pytest.raises(ValueError):
        q.remove(blocks[0])
    q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_free_queue_random_ops_match_a_list_model():
    rng = random.Random(0)
    blocks = [KVCacheBlock(i) for i in range(30)]
    q = FreeKVCacheBlockQueue(blocks)
    model = list(blocks)
    for _ in range(3000):
        op = rng.random()
        if op < 0.3 and model:
            assert q.popleft() is model.pop(0)
        elif op < 0.6 and model:
            b = rng.choice(model)
            model.remove(b)
            q.remove(b)
        else:
            free_now = {b.block_id for b in model}
            candidates = [b for b in blocks if b.block_id not in free_now]
            if candidates:
                b = rng.choice(candidates)
                q.append(b)
                model.append(b)
        assert ids(q) == ids(model) and len(q) == len(model)


# -- BlockPool ---------------------------------------------------------------------------------


def test_initial_state():
    pool = BlockPool(8)
    pool.check_integrity()
    assert pool.get_num_free_blocks() == 8
    assert pool.get_usage() == 0.0
    with pytest.raises(ValueError):
        BlockPool(0)


def test_get_new_blocks_pops_lru_and_sets_ref():
    pool = BlockPool(6)
    got = pool.get_new_blocks(4)
    assert ids(got) == [0, 1, 2, 3]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.get_num_free_blocks() == 2
    assert pool.get_usage() == pytest.approx(4 / 6)
    pool.check_integrity()
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    pool.check_integrity()


def test_free_in_reverse_evicts_tail_first():
    pool = BlockPool(4)
    req_blocks = pool.get_new_blocks(4)
    pool.free_blocks(reversed(req_blocks))
    pool.check_integrity()
    # The request's last block was freed first, so it is reused first.
    assert ids(pool.free_block_queue) == [3, 2, 1, 0]
    assert ids(pool.get_new_blocks(1)) == [3]
    pool.check_integrity()


def test_double_free_raises():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(ValueError):
        pool.free_blocks([b])


def test_touch_takes_cached_block_out_of_the_middle_of_the_free_queue():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(blocks[:3], [100, 101, 102])
    pool.free_blocks(blocks)
    assert ids(pool.free_block_queue) == [0, 1, 2, 3, 4]
    hit = pool.get_cached_block(101)
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert ids(pool.free_block_queue) == [0, 2, 3, 4]
    pool.check_integrity()
    pool.touch([hit])  # a second request shares it: only the ref count moves
    assert hit.ref_cnt == 2 and pool.get_num_free_blocks() == 4
    pool.free_blocks([hit, hit])
    assert ids(pool.free_block_queue) == [0, 2, 3, 4, 1]
    assert pool.get_cached_block(101) is hit  # still cached while free
    pool.check_integrity()


def test_reuse_evicts_hash_and_only_unreferenced_blocks_are_evicted():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, [10, 11, 12, 13])
    pool.free_blocks([blocks[0], blocks[1]])  # blocks 2 and 3 stay referenced
    fresh = pool.get_new_blocks(2)
    assert ids(fresh) == [0, 1]
    assert all(b.block_hash is None for b in fresh)
    assert pool.get_cached_block(10) is None and pool.get_cached_block(11) is None
    assert pool.get_cached_block(12) is blocks[2] and pool.get_cached_block(13) is blocks[3]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)  # referenced cached blocks are never evicted
    pool.check_integrity()


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(3)
    a, b, _ = pool.get_new_blocks(3)
    pool.cache_full_blocks([a], [7])
    pool.cache_full_blocks([b], [7])
    assert pool.get_cached_block(7) is a and b.block_hash is None
    pool.cache_full_blocks([a], [7])  # already cached: no-op
    pool.check_integrity()


def test_caching_disabled_caches_nothing():
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [1, 2])
    assert pool.get_cached_block(1) is None
    pool.check_integrity()


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [1, 2])
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(1) is None
    pool.check_integrity()


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda p: setattr(p.blocks[0], "ref_cnt", 1),  # referenced but free
        lambda p: p.free_block_queue.remove(p.blocks[1]),  # unreferenced but not free: a leak
        lambda p: p.cached_block_hash_to_block.__setitem__(5, p.blocks[2]),  # map entry w/o hash
        lambda p: setattr(p.blocks[3], "block_hash", 9),  # hash without map entry
    ],
)
def test_check_integrity_detects_corruption(corrupt):
    pool = BlockPool(4)
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_random_pool_operations_keep_integrity():
    rng = random.Random(1)
    pool = BlockPool(16)
    held: list[list] = []
    next_hash = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.35:
            n = rng.randint(1, 4)
            if n <= pool.get_num_free_blocks():
                held.append(pool.get_new_blocks(n))
        elif op < 0.6 and held:
            blocks = held.pop(rng.randrange(len(held)))
            pool.free_blocks(reversed(blocks))
        elif op < 0.8 and held:
            blocks = [b for b in rng.choice(held) if b.block_hash is None]
            pool.cache_full_blocks(blocks, list(range(next_hash, next_hash + len(blocks))))
            next_hash += len(blocks)
        elif pool.cached_block_hash_to_block:
            block = pool.get_cached_block(rng.choice(list(pool.cached_block_hash_to_block)))
            pool.touch([block])
            held.append([block])
        pool.check_integrity()
        assert pool.get_num_free_blocks() == sum(1 for b in pool.blocks if b.ref_cnt == 0)
    for blocks in held:
        pool.free_blocks(reversed(blocks))
    pool.check_integrity()
    assert pool.get_num_free_blocks() == 16
