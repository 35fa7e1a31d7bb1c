"""KVCacheManager: which blocks each request holds, prefix-cache lookups, allocation and freeing.

Prefix caching: a *full* block (``block_size`` token ids) is identified by a hash chained over
every block before it, ``hash((parent_hash, tuple(block_token_ids)))`` with ``parent_hash=None``
for the first block, so equal hashes mean equal whole prefixes, not just equal blocks. A request
with a LoRA adapter chains its first block to ``hash(("lora", lora_int_id))`` instead of None: its
KV depends on the adapter, so two adapters (or an adapter and the base model) never share a block.

Collision risk: Python's ``hash`` of a tuple is 64 bits. With N distinct cached blocks the chance
that any two collide is about N**2 / 2**65 (for a million blocks about 3e-8); a collision would
silently reuse another prefix's KV. Acceptable for an engine of this size; a cryptographic hash
(vLLM's sha256 option) would remove it at a higher cost per block.
"""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.request import Request


def hash_block_tokens(parent_block_hash: int | None, block_token_ids: tuple[int, ...] | list[int]) -> int:
    """Hash of one full block, chained to the hash of the block before it (None for the first)."""
    return hash((parent_block_hash, tuple(block_token_ids)))


def update_block_hashes(request: Request, block_size: int) -> list[int]:
    """Extend ``request.block_hashes`` to cover every full block of its known tokens.

    Cost: O(tokens in the new full blocks); already hashed blocks are never rehashed.
    """
    hashes = request.block_hashes
    num_full_blocks = request.num_tokens // block_size
    token_ids = request.all_token_ids
    for i in range(len(hashes), num_full_blocks):
        parent = hashes[i - 1] if i > 0 else _first_block_parent(request)
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


def _first_block_parent(request: Request) -> int | None:
    """What the first block's hash chains to: None for the base model, the adapter's key with LoRA."""
    lora = request.lora_request
    return None if lora is None else hash(("lora", lora.lora_int_id))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Per-request block lists on top of a BlockPool.

    Invariant: ``req_to_blocks[r]`` holds ``cdiv(tokens allocated for r, block_size)`` blocks, one
    reference each (tokens allocated: the most ``r`` ever needed since it was admitted, rejected
    draft slots included, so at least its computed tokens); a block's ``ref_cnt`` equals the number of lists it appears in. The first
    ``num_cached_blocks[r]`` blocks of a request are registered in the prefix cache (or were
    skipped as duplicates).
    Cost: lookup O(prefix blocks); allocate_slots O(new blocks + hit blocks); free O(blocks held).

    Stats: ``prefix_cache_queries`` / ``prefix_cache_hits`` count tokens looked up / tokens found,
    once per admission (a request that waits and retries is not counted twice; a preempted
    request that is resumed is counted again, since its hits again save recomputation).
    """

    def __init__(self, block_size: int, num_blocks: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of KV blocks held by live requests (free-but-cached blocks count as free)."""
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def _lookup_enabled(self, request: Request) -> bool:
        # Prompt logprobs need the logits of every prompt position, so nothing may be skipped.
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request's tokens: (blocks, number of tokens they cover).

        Never the whole sequence: at most ``num_tokens - 1`` tokens, rounded down to whole blocks,
        so at least one token is computed and yields the logits for the next token. Pure lookup:
        no reference is taken and no stats are counted until ``allocate_slots`` succeeds.
        """
        if not self._lookup_enabled(request):
            return [], 0
        block_hashes = update_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for ``num_computed_tokens + num_new_computed_tokens + num_new_tokens +
        num_lookahead_tokens`` tokens.

        ``new_computed_blocks`` are prefix hits from ``get_computed_blocks`` (first allocation only).
        ``num_lookahead_tokens`` are slots for draft tokens: if the step rejects some, the
        scheduler rolls ``num_computed_tokens`` back and the request keeps the blocks, whose slots
        the next tokens overwrite (nothing is copied or freed).
        Returns the ids of the newly allocated blocks (possibly empty), or None, changing nothing,
        when the pool cannot supply them. Free-but-cached blocks count as available (evictable),
        except the hit blocks themselves, which this call takes out of the free queue.
        """
        hit_blocks = new_computed_blocks or []
        req_id = request.request_id
        held = self.req_to_blocks.get(req_id)
        num_held = len(held) if held is not None else 0
        num_tokens_needed = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_new_blocks = cdiv(num_tokens_needed, self.block_size) - num_held - len(hit_blocks)
        assert not (hit_blocks and held), "prefix hits are only taken on a request's first allocation"
        num_free_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_free_hits:
            return None
        # Touch hits before taking new blocks, so eviction cannot pick them.
        self.block_pool.touch(hit_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        if held is None:
            held = self.req_to_blocks[req_id] = []
            self.num_cached_blocks[req_id] = len(hit_blocks)
            if self._lookup_enabled(request):
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens
        held.extend(hit_blocks)
        held.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full of *computed* KV in the prefix cache.

        Called after a step has written the KV of the first ``num_computed_tokens`` tokens, all of
        them accepted ones (``Request.all_token_ids``): the hashes never cover a draft token.
        """
        if not self.enable_caching:
            return
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            return
        num_known = min(num_computed_tokens, request.num_tokens)  # ids of tokens in flight are unknown
        num_full_blocks = min(num_known // self.block_size, len(blocks))
        num_cached = self.num_cached_blocks[req_id]
        if num_full_blocks <= num_cached:
            return
        hashes = update_block_hashes(request, self.block_size)
        self.block_pool.cache_full_blocks(blocks[num_cached:num_full_blocks], hashes[num_cached:num_full_blocks])
        self.num_cached_blocks[req_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release every block of the request (idempotent), last block first (evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants plus: every ref count equals the number of requests holding the block."""
        self.block_pool.check_integrity()
        holders = [0] * self.num_blocks
        for blocks in self.req_to_blocks.values():
            assert len({b.block_id for b in blocks}) == len(blocks), "a request holds a block twice"
            for block in blocks:
                holders[block.block_id] += 1
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"{block}: ref_cnt {block.ref_cnt} but held by {holders[block.block_id]} requests"
            )
