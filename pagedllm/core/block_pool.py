"""KV-cache blocks, their reference counts, the LRU free queue and the hash -> block map.

A *block* is a fixed-size page of the KV cache (``block_size`` token slots in every layer). This
module only does the bookkeeping; the tensors live in the worker. Pure Python, no torch.

Life of a block::

    free (ref_cnt 0, no hash) --get_new_blocks--> in use (ref_cnt >= 1)
    in use --cache_full_blocks--> in use and cached (carries the hash of its full contents)
    in use --free_blocks, last reference--> free; a cached block keeps its hash (evictable)
    free and cached --touch (prefix hit)--> in use again, KV reused without recomputation
    free and cached --get_new_blocks--> hash evicted, handed out as a fresh block
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence


class KVCacheBlock:
    """Metadata of one KV-cache block.

    Invariant: ``ref_cnt`` is the number of requests holding the block; the block sits in the free
    queue iff ``ref_cnt == 0``; ``block_hash`` is set only while the block is in the pool's
    hash -> block map. ``prev_free``/``next_free`` are the free-queue links (None when not queued).
    Cost: O(1) space, five slots.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order: the head is evicted first (LRU).

    Why a linked list and not a ``collections.deque``: a prefix-cache hit on a free cached block
    must pull that block out of the *middle* of the queue. ``deque.remove`` is a linear scan;
    unlinking through the block's own ``prev_free``/``next_free`` pointers is O(1). Two sentinel
    nodes (head and tail) remove every empty-list special case.

    Invariant: the blocks between the sentinels are exactly the blocks with ``ref_cnt == 0``, each
    once, and ``num_free_blocks`` is their count. A block is queued iff ``prev_free is not None``.
    Cost: popleft, remove and append are O(1); iteration is O(n).
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        assert block is not None
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next_free


class BlockPool:
    """All KV-cache blocks of one engine: ref counts, LRU free queue, prefix-cache hash map.

    Invariant (``check_integrity``): free + in use == total, where free means ``ref_cnt == 0`` and
    queued; free blocks may still carry a hash (cached, evictable); every map entry ``h -> b`` has
    ``b.block_hash == h`` and every hashed block is in the map.
    Cost: get_new_blocks / free_blocks / touch are O(number of blocks passed); lookups are O(1);
    check_integrity is O(num_blocks) and meant for tests.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # Full-block content hash -> the one block that holds it (free or in use).
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included: they are evicted on demand."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by live requests (``ref_cnt > 0``)."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head (least recently freed) with ref_cnt 1.

        A taken block that was cached loses its hash: its contents are about to be overwritten.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.get_num_free_blocks()} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0, block
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks reaching 0 join the free queue's tail in order.

        The first block appended is the first evicted, so a request passes its blocks in *reverse*:
        its tail-most blocks (least likely to be shared as a prefix) are evicted first.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block (a prefix hit), unqueueing blocks that were free."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[int]) -> None:
        """Register ``blocks[i]`` (full, KV computed) under ``block_hashes[i]``.

        A block already cached is left alone; a hash already held by another block is not
        registered twice (the first block keeps it, the duplicate stays uncached).
        """
        if not self.enable_caching:
            return
        assert len(blocks) == len(block_hashes)
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is not None:
                assert block.block_hash == block_hash, (block, block_hash)
                continue
            if block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no request holds a block."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def check_integrity(self) -> None:
        """Assert the pool's invariants (O(num_blocks); tests call it after every step)."""
        queued = list(self.free_block_queue)
        queued_ids = {b.block_id for b in queued}
        assert len(queued_ids) == len(queued), "a block is in the free queue twice"
        assert len(queued) == self.free_block_queue.num_free_blocks, "free-queue count is wrong"
        in_use = cached_free = empty_free = 0
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"negative ref count: {block}"
            if block.ref_cnt > 0:
                in_use += 1
                assert block.block_id not in queued_ids, f"referenced block is free: {block}"
                assert block.prev_free is None and block.next_free is None, f"stale links: {block}"
            else:
                assert block.block_id in queued_ids, f"unreferenced block is not free (leak): {block}"
                if block.block_hash is None:
                    empty_free += 1
                else:
                    cached_free += 1
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, (
                    f"hashed block missing from the map: {block}"
                )
        assert in_use + cached_free + empty_free == self.num_blocks, "blocks lost"
        assert cached_free + empty_free == len(queued), "free count mismatch"
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"map entry {block_hash} -> {block}"
