"""The Attention layer: the only place a model touches the paged KV cache.

It owns nothing but its shape and its cache tensor; the batch's metadata and the backend come from
the scoped forward context that the runner opens around each forward pass.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backend import get_forward_context


class Attention(nn.Module):
    """``forward(q [T, H*D], k [T, Hkv*D], v [T, Hkv*D]) -> [T, H*D]``: store k/v in ``self.kv_cache``
    at the batch's slots, then attend (causal, over each request's cached prefix and itself).

    ``self.kv_cache`` is ``[2, num_blocks, block_size, Hkv, D]``, bound by the runner after it sizes the
    cache (``model.bind_kv_caches``); it is an empty tensor until then. It is a plain attribute, not a
    buffer: it is neither saved in the state dict nor moved by ``.to()``.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int | None = None,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
        super().__init__()
        if sliding_window is not None and (type(sliding_window) is not int or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be positive or None, got {logits_soft_cap!r}")
        # This layer's options (attention/backend.py): keys older than the window are not seen;
        # scores are soft-capped. None turns each off.
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache = torch.empty(0)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def kv_store_target(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(kv_cache, slot_mapping)`` for a kernel that writes this step's K/V into the cache itself
        (then call ``forward(q, None, None, kv_stored=True)``), or None where this step's backend
        stores K/V itself (the CPU reference) or no cache is bound yet."""
        ctx = get_forward_context()
        if not ctx.backend.accepts_stored_kv or self.kv_cache.numel() == 0:
            return None
        return self.kv_cache, ctx.attn_metadata.slot_mapping

    def fused_kv_store(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(value [T, Hkv, D], kv_cache, slot_mapping)`` for a RoPE kernel that stores K/V
        (``kv_store_target`` plus the value to store), or None as there."""
        target = self.kv_store_target()
        if target is None:
            return None
        return v.view(v.shape[0], self.num_kv_heads, self.head_dim), *target

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_stored: bool = False
    ) -> torch.Tensor:
        """With ``kv_stored`` this step's k/v are already in the cache (``kv_store_target``); k and v may
        then be None."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        if k is not None:
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if v is not None:
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        ctx = get_forward_context()
        out = ctx.backend.forward(q, k, v, self.kv_cache, ctx.attn_metadata, self.scale, kv_stored=kv_stored,
                                  sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        extra = "".join(f", {name}={value}" for name in ("sliding_window", "logits_soft_cap")
                        if (value := getattr(self, name)) is not None)
        return f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}{extra}"
