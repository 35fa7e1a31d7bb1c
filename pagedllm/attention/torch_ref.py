"""Reference attention in plain torch: the oracle for every backend (the Triton kernels and the
native CPU decode kernel), the CPU backend's prefill path, and the whole CPU path where the native
kernels cannot be built.

Cost per layer: one scatter of the new K/V into the cache, then decode requests (query_len 1) in
a few padded ``scaled_dot_product_attention`` calls, one per group of similar context lengths (the
grouping is planned once per step: a single padded batch would gather up to the longest context for
every request, several times the keys at mixed lengths), and every other request (prefill / chunked
prefill) attended one by one with an explicit causal-with-prefix mask.

Per layer options (``backend.py``): a sliding window gathers only the blocks that hold keys inside
some query's window (the blocks before are never read: a sliding model may have freed them) and
masks the rest of the window's edge; a logit soft cap replaces SDPA by the explicit product
(``cap * tanh(scores / cap)`` before the mask and the softmax, in float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionInputs,
)
from pagedllm.attention.kv_dtype import from_cache_dtype, to_cache_dtype


@dataclass
class HostPlannedMetadata(AttentionMetadata):
    """Metadata of the backends that plan on the host (this one and the CPU backend): the common
    fields plus host lists of ``query_start_loc`` and ``seq_lens``."""

    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None


class HostPlannedMetadataBuilder(AttentionMetadataBuilder):
    """Adds the host lists (from the staged host arrays when given, else one device read)."""

    def build(self, common: CommonAttentionInputs) -> HostPlannedMetadata:
        qsl, lens = common.query_start_loc_host, common.seq_lens_host
        return HostPlannedMetadata(
            common.num_actual_tokens, common.max_query_len, common.query_start_loc, common.seq_lens,
            common.block_tables, common.slot_mapping,
            query_start_loc_cpu=(qsl if qsl is not None else common.query_start_loc).tolist(),
            seq_lens_cpu=(lens if lens is not None else common.seq_lens).tolist(),
        )


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's K/V into its slot (cast to the cache's dtype, saturating for float8:
    ``kv_dtype.to_cache_dtype``); slots < 0 (padding) are skipped."""
    num_tokens = key.shape[0]
    slots = slot_mapping[:num_tokens]
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    key, value = to_cache_dtype(key, kv_cache.dtype), to_cache_dtype(value, kv_cache.dtype)
    if kv_cache.element_size() == 1:  # torch has no float8 index_copy on the CPU: copy the bytes
        flat, key, value = flat.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
    flat[0].index_copy_(0, slots, key)
    flat[1].index_copy_(0, slots, value)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
              first_block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one request at positions ``first_block * block_size .. seq_len - 1``: each
    ``[seq_len - first_block * block_size, num_kv_heads, head_dim]`` (blocks before ``first_block``
    are not read)."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[first_block:num_blocks].long()
    length = seq_len - first_block * block_size
    k = kv_cache[0].index_select(0, blocks).reshape(-1, kv_cache.shape[-2], kv_cache.shape[-1])[:length]
    v = kv_cache[1].index_select(0, blocks).reshape(-1, kv_cache.shape[-2], kv_cache.shape[-1])[:length]
    return k, v


def soft_capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                          soft_cap: float) -> torch.Tensor:
    """SDPA's function with a logit soft cap: ``softmax(mask(cap * tanh(q k^T * scale / cap))) v``
    over ``q [B, Hkv, M, D]``, ``k/v [B, Hkv, L, D]``; ``mask`` bool (True = visible) or additive
    float, broadcastable to ``[B, Hkv, M, L]``. Scores and softmax in float32."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    return torch.matmul(scores.softmax(-1), v.float()).to(v.dtype)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
          soft_cap: float | None) -> torch.Tensor:
    if soft_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return soft_capped_attention(q, k, v, mask, scale, soft_cap)


def window_start(position: int, sliding_window: int | None) -> int:
    """The first key position a query at ``position`` sees: ``position - window + 1`` (not below 0)."""
    return 0 if sliding_window is None else max(0, position - sliding_window + 1)


def _grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                  soft_cap: float | None = None) -> torch.Tensor:
    """GQA attention without copying K/V per query head: q ``[B, Lq, H, D]``, k/v ``[B, L, Hkv, D]``,
    ``mask`` bool broadcastable to ``[B, Lq, L]``; returns ``[B, Lq, H, D]``.

    Query head ``h`` uses KV head ``h // rep`` (``rep = H // Hkv``), so the ``rep`` heads of a group
    are folded into the query-length dim: one SDPA over ``[B, Hkv, rep * Lq, D]`` queries (the mask
    repeated per folded head), with K/V read as strided views."""
    B, Lq, H, D = q.shape
    Hkv = k.shape[2]
    rep = H // Hkv
    qg = q.permute(0, 2, 1, 3).reshape(B, Hkv, rep * Lq, D).to(k.dtype)
    mask = mask.expand(B, Lq, mask.shape[-1])
    if rep > 1:
        mask = mask.repeat(1, rep, 1)
    o = _sdpa(qg, k.transpose(1, 2), v.transpose(1, 2), mask.unsqueeze(1), scale, soft_cap)  # [B, Hkv, rep * Lq, D]
    return o.reshape(B, H, Lq, D).permute(0, 2, 1, 3)


@dataclass
class DecodeGroup:
    """Decode requests of similar context length, attended in one padded SDPA call.

    ``rows``: their query rows; ``blocks``: ``num_blocks`` block ids of each, flattened
    ``[B * num_blocks]``, from the block holding its first visible key (block 0 without a sliding
    window); ``mask``: additive float ``[B, 1, 1, max_len]`` over the gathered keys, 0 where a key
    is visible (inside the context and the window) and -inf elsewhere (broadcast over heads)."""

    rows: torch.Tensor
    blocks: torch.Tensor
    num_blocks: int
    max_len: int
    mask: torch.Tensor


@dataclass
class DecodePlan:
    """How one step's decode requests are grouped; built once per step, shared by every layer."""

    groups: list[DecodeGroup]


# A group's padding may add this share of its real keys before the next shorter request starts
# a new group; each extra group costs two gathers and one SDPA call.
MAX_PADDING_SHARE = 0.25


def plan_decode_groups(seq_lens: list[int], rows: list[int], block_tables: torch.Tensor, block_size: int,
                       device: torch.device, sliding_window: int | None = None) -> DecodePlan:
    """Group decode requests by the number of keys they read so the padded gather wastes little.

    A request reads from the block holding its first visible key (``window_start``) to its end.
    Requests are taken longest first; a group stays open while adding the next one keeps its
    padded size ``B * max_len`` within ``(1 + MAX_PADDING_SHARE)`` of its real keys. Cost: one sort
    and a handful of small tensors per group, once per step (per window)."""
    first_blocks = [window_start(n - 1, sliding_window) // block_size for n in seq_lens]
    lens = [n - b * block_size for n, b in zip(seq_lens, first_blocks)]  # keys gathered per request
    order = sorted(range(len(rows)), key=lambda i: -lens[i])
    groups, current, real = [], [], 0
    for i in order:
        longest = lens[current[0]] if current else lens[i]
        if current and longest * (len(current) + 1) > (1 + MAX_PADDING_SHARE) * (real + lens[i]):
            groups.append(current)
            current, real = [], 0
        current.append(i)
        real += lens[i]
    if current:
        groups.append(current)
    out = []
    for members in groups:
        max_len = lens[members[0]]
        num_blocks = (max_len + block_size - 1) // block_size
        reqs = torch.tensor([rows[i] for i in members], device=device)
        tables = block_tables[torch.tensor(members, device=device)]
        if sliding_window is None:
            blocks = tables[:, :num_blocks].long().flatten()
        else:  # from each request's first block; past its table's end: clamped, masked below
            starts = torch.tensor([first_blocks[i] for i in members], device=device)
            index = (starts[:, None] + torch.arange(num_blocks, device=device)[None, :]).clamp_(max=tables.shape[1] - 1)
            blocks = tables.gather(1, index).long().flatten()
        key_pos = torch.arange(max_len, device=device).unsqueeze(0)  # relative to the first gathered block
        outside = key_pos >= torch.tensor([lens[i] for i in members], device=device).unsqueeze(1)
        if sliding_window is not None:
            first = [window_start(seq_lens[i] - 1, sliding_window) - first_blocks[i] * block_size for i in members]
            outside |= key_pos < torch.tensor(first, device=device).unsqueeze(1)
        mask = torch.zeros(len(members), 1, 1, max_len, device=device).masked_fill_(outside[:, None, None], float("-inf"))
        out.append(DecodeGroup(reqs, blocks, num_blocks, max_len, mask))
    return DecodePlan(out)


def paged_attention_ref(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: HostPlannedMetadata, scale: float,
    decode_plan: DecodePlan | None = None, sliding_window: int | None = None, logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention over keys already stored in the paged cache (see backend.py for the semantics).
    ``decode_plan`` (from ``plan_decode_groups`` with the same ``sliding_window``) may be passed to
    reuse one step's grouping."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    out = torch.empty_like(query)
    if decode_plan is None:
        decode_plan = _plan_for(meta, kv_cache.shape[2], query.device, sliding_window)
    for group in decode_plan.groups:
        _decode_group(query, kv_cache, group, scale, out, logits_soft_cap)
    prefill_attention_ref(query, kv_cache, meta, scale, out, sliding_window, logits_soft_cap)
    return out.view(-1, num_heads, head_dim)


def prefill_attention_ref(query: torch.Tensor, kv_cache: torch.Tensor, meta: HostPlannedMetadata, scale: float,
                          out: torch.Tensor, sliding_window: int | None = None,
                          logits_soft_cap: float | None = None, min_query_len: int = 2) -> None:
    """The requests with at least ``min_query_len`` (> 1) query tokens (prefill, chunked prefill),
    one SDPA call each over its gathered context (from the block of its first query's first visible
    key) with the causal-with-prefix mask (and the window's); written into ``out`` at their rows."""
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    block_size = kv_cache.shape[2]
    for r in range(len(seq_lens)):
        q_start, q_end = qsl[r], qsl[r + 1]
        q_len = q_end - q_start
        if q_len < min_query_len:
            continue
        seq_len = seq_lens[r]
        first_block = window_start(seq_len - q_len, sliding_window) // block_size
        k, v = (from_cache_dtype(t, query.dtype)
                for t in gather_kv(kv_cache, meta.block_tables[r], seq_len, first_block))
        # Query j (position seq_len - q_len + j) sees keys 0..seq_len - q_len + j (within its window).
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(first_block * block_size, seq_len, device=query.device).unsqueeze(0)
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        o = _grouped_sdpa(query[q_start:q_end].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask, scale,
                          logits_soft_cap)
        out[q_start:q_end] = o[0].to(out.dtype)


def _plan_for(meta: HostPlannedMetadata, block_size: int, device: torch.device,
              sliding_window: int | None = None) -> DecodePlan:
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    reqs = [r for r in range(len(seq_lens)) if qsl[r + 1] - qsl[r] == 1]
    if not reqs:
        return DecodePlan([])
    return plan_decode_groups([seq_lens[r] for r in reqs], [qsl[r] for r in reqs],
                              meta.block_tables[torch.tensor(reqs, device=device)], block_size, device,
                              sliding_window)


def _decode_group(query, kv_cache, group: DecodeGroup, scale: float, out: torch.Tensor,
                  logits_soft_cap: float | None = None) -> None:
    """One group's single-token queries in one SDPA call (keys padded to the group's longest)."""
    B = group.rows.shape[0]
    block_size = kv_cache.shape[2]
    shape = (B, group.num_blocks * block_size, kv_cache.shape[-2], kv_cache.shape[-1])
    k = from_cache_dtype(kv_cache[0].index_select(0, group.blocks).view(shape)[:, :group.max_len], query.dtype)
    v = from_cache_dtype(kv_cache[1].index_select(0, group.blocks).view(shape)[:, :group.max_len], query.dtype)
    num_heads, head_dim, num_kv_heads = query.shape[1], query.shape[2], kv_cache.shape[-2]
    # GQA as in _grouped_sdpa: the heads of a KV group are the query rows of one SDPA "head".
    qg = query[group.rows].view(B, num_kv_heads, num_heads // num_kv_heads, head_dim).to(k.dtype)
    o = _sdpa(qg, k.transpose(1, 2), v.transpose(1, 2), group.mask.to(k.dtype), scale,
              logits_soft_cap)  # [B, Hkv, rep, D]
    out[group.rows] = o.reshape(B, num_heads, head_dim).to(out.dtype)


class TorchRefBackend(AttentionBackend):
    """The reference backend. It plans a step's decode groups at its first layer of each sliding
    window (None: full attention) and reuses the plan for the other layers of the same step (the
    metadata object identifies the step)."""

    name = "torch_ref"
    metadata_builder = HostPlannedMetadataBuilder()

    def __init__(self) -> None:
        self._plan_meta: HostPlannedMetadata | None = None
        self._plans: dict[int | None, DecodePlan] = {}  # by sliding window, for ``_plan_meta``'s step

    def decode_plan(self, meta: HostPlannedMetadata, block_size: int, device: torch.device,
                    sliding_window: int | None) -> DecodePlan:
        """This step's decode grouping for layers with ``sliding_window`` (planned once per step)."""
        if self._plan_meta is not meta:
            self._plan_meta, self._plans = meta, {}
        plan = self._plans.get(sliding_window)
        if plan is None:
            plan = self._plans[sliding_window] = _plan_for(meta, block_size, device, sliding_window)
        return plan

    def forward(self, query, key, value, kv_cache, meta, scale, kv_stored=False, sliding_window=None,
                logits_soft_cap=None):
        n = meta.num_actual_tokens
        if kv_stored:
            raise ValueError("the torch_ref backend stores K/V itself (accepts_stored_kv is False)")
        store_kv_cache(key[:n], value[:n], kv_cache, meta.slot_mapping[:n])
        plan = self.decode_plan(meta, kv_cache.shape[2], query.device, sliding_window)
        out = torch.zeros_like(query)
        out[:n] = paged_attention_ref(query[:n], kv_cache, meta, scale, plan, sliding_window, logits_soft_cap)
        return out
