"""Reference attention in plain torch: the CPU path and the oracle for every GPU kernel.

Cost per layer: one scatter of the new K/V into the cache, then decode requests (query_len 1)
batched into one padded ``scaled_dot_product_attention`` call, and every other request
(prefill / chunked prefill) attended one by one with an explicit causal-with-prefix mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's K/V into its slot; slots < 0 (padding) are skipped."""
    num_tokens = key.shape[0]
    slots = slot_mapping[:num_tokens]
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    flat[0].index_copy_(0, slots, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, value.to(kv_cache.dtype))


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` keys and values of one request: each ``[seq_len, num_kv_heads, head_dim]``."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    k = kv_cache[0].index_select(0, blocks).reshape(-1, kv_cache.shape[-2], kv_cache.shape[-1])[:seq_len]
    v = kv_cache[1].index_select(0, blocks).reshape(-1, kv_cache.shape[-2], kv_cache.shape[-1])[:seq_len]
    return k, v


def _grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
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
    o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask.unsqueeze(1),
                                       scale=scale)  # [B, Hkv, rep * Lq, D]
    return o.reshape(B, H, Lq, D).permute(0, 2, 1, 3)


def paged_attention_ref(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention over keys already stored in the paged cache (see backend.py for the semantics)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    qsl = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
    out = torch.empty_like(query)
    decode_reqs = [r for r in range(len(seq_lens)) if qsl[r + 1] - qsl[r] == 1]
    if decode_reqs:
        _decode_batch(query, kv_cache, meta.block_tables, decode_reqs, qsl, seq_lens, scale, out)
    for r in range(len(seq_lens)):
        q_start, q_end = qsl[r], qsl[r + 1]
        q_len = q_end - q_start
        if q_len <= 1:
            continue
        seq_len = seq_lens[r]
        k, v = gather_kv(kv_cache, meta.block_tables[r], seq_len)
        # Query j (position seq_len - q_len + j) sees keys 0..seq_len - q_len + j.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
        mask = k_pos <= q_pos
        o = _grouped_sdpa(query[q_start:q_end].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask, scale)
        out[q_start:q_end] = o[0].to(out.dtype)
    return out.view(-1, num_heads, head_dim)


def _decode_batch(query, kv_cache, block_tables, reqs, qsl, seq_lens, scale, out) -> None:
    """All single-token queries in one padded SDPA call (keys padded to the longest context)."""
    block_size = kv_cache.shape[2]
    lens = [seq_lens[r] for r in reqs]
    max_len = max(lens)
    max_blocks = (max_len + block_size - 1) // block_size
    idx = torch.tensor(reqs, device=query.device)
    tables = block_tables[idx, :max_blocks].long().flatten()  # [B * max_blocks]
    B = len(reqs)
    shape = (B, max_blocks * block_size, kv_cache.shape[-2], kv_cache.shape[-1])
    k = kv_cache[0].index_select(0, tables).view(shape)[:, :max_len]
    v = kv_cache[1].index_select(0, tables).view(shape)[:, :max_len]
    rows = torch.tensor([qsl[r] for r in reqs], device=query.device)
    lens_t = torch.tensor(lens, device=query.device)
    mask = (torch.arange(max_len, device=query.device).unsqueeze(0) < lens_t.unsqueeze(1)).unsqueeze(1)  # [B, 1, L]
    o = _grouped_sdpa(query[rows].unsqueeze(1), k, v, mask, scale)  # [B, 1, H, D]
    out[rows] = o[:, 0].to(out.dtype)


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"

    def forward(self, query, key, value, kv_cache, meta, scale):
        n = meta.num_actual_tokens
        store_kv_cache(key[:n], value[:n], kv_cache, meta.slot_mapping[:n])
        out = torch.zeros_like(query)
        out[:n] = paged_attention_ref(query[:n], kv_cache, meta, scale)
        return out
