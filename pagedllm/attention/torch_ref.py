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
    k = kv_cache[0, blocks].reshape(-1, kv_cache.shape[-2], kv_cache.shape[-1])[:seq_len]
    v = kv_cache[1, blocks].reshape(-1, kv_cache.shape[-2], kv_cache.shape[-1])[:seq_len]
    return k, v


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[L, Hkv, D] -> [Hq, L, D] (GQA: each KV head serves num_heads // Hkv query heads)."""
    rep = num_heads // x.shape[1]
    x = x.transpose(0, 1)
    return x.repeat_interleave(rep, dim=0) if rep > 1 else x


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
        q = query[q_start:q_end].transpose(0, 1)  # [H, q_len, D]
        # Query j (position seq_len - q_len + j) sees keys 0..seq_len - q_len + j.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
        mask = k_pos <= q_pos
        o = F.scaled_dot_product_attention(
            q.to(k.dtype), _expand_kv(k, num_heads), _expand_kv(v, num_heads), attn_mask=mask, scale=scale
        )
        out[q_start:q_end] = o.transpose(0, 1).to(out.dtype)
    return out.view(-1, num_heads, head_dim)


def _decode_batch(query, kv_cache, block_tables, reqs, qsl, seq_lens, scale, out) -> None:
    """All single-token queries in one padded SDPA call (keys padded to the longest context)."""
    num_heads = query.shape[1]
    block_size = kv_cache.shape[2]
    lens = [seq_lens[r] for r in reqs]
    max_len = max(lens)
    max_blocks = (max_len + block_size - 1) // block_size
    idx = torch.tensor(reqs, device=query.device)
    tables = block_tables[idx, :max_blocks].long()  # [B, max_blocks]
    B = len(reqs)
    k = kv_cache[0, tables].reshape(B, max_blocks * block_size, kv_cache.shape[-2], kv_cache.shape[-1])[:, :max_len]
    v = kv_cache[1, tables].reshape(B, max_blocks * block_size, kv_cache.shape[-2], kv_cache.shape[-1])[:, :max_len]
    rep = num_heads // k.shape[2]
    k = k.transpose(1, 2)  # [B, Hkv, L, D]
    v = v.transpose(1, 2)
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    rows = torch.tensor([qsl[r] for r in reqs], device=query.device)
    q = query[rows].unsqueeze(2).to(k.dtype)  # [B, H, 1, D]
    lens_t = torch.tensor(lens, device=query.device)
    mask = (torch.arange(max_len, device=query.device).unsqueeze(0) < lens_t.unsqueeze(1))[:, None, None, :]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, H, 1, D]
    out[rows] = o.squeeze(2).to(out.dtype)


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"

    def forward(self, query, key, value, kv_cache, meta, scale):
        n = meta.num_actual_tokens
        store_kv_cache(key[:n], value[:n], kv_cache, meta.slot_mapping[:n])
        out = torch.zeros_like(query)
        out[:n] = paged_attention_ref(query[:n], kv_cache, meta, scale)
        return out
