"""Attention backends behind one boundary (see backend.py)."""

from pagedllm.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    ForwardContext,
    forward_context,
    get_attention_backend,
    get_forward_context,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ForwardContext",
    "forward_context",
    "get_attention_backend",
    "get_forward_context",
]
