"""GPU attention backend: Triton kernels for the KV store and paged attention.

``TritonBackend.forward`` does what the base class documents (``backend.py``): store the new K/V at
``meta.slot_mapping`` (slots < 0 are padding and skipped), then attend over the paged cache.

Dispatch (cost per layer): one KV-store launch, then
- the split-KV decode kernel plus its reduce kernel (``paged_attention.paged_decode``) for the
  requests with ``query_len == 1``; its programs for other requests exit at once. No host sync and
  a launch grid that depends only on ``num_reqs`` and constants, so a pure decode batch
  (``meta.max_query_len == 1``: nothing else is launched) can be captured in a CUDA graph at a
  padded batch size;
- when ``meta.max_query_len > 1``, one launch of the unified ragged kernel
  (``paged_attention.unified_attention(skip_decodes=True)``) for prefill, chunked prefill with a
  cached prefix, and any other ``query_len > 1`` request. Splitting a mixed batch this way keeps
  decodes off the tall prefill tiles (measured on an H200: 1 prefill of 2048 + 255 decodes took
  809 us in one unified launch with 128-row tiles, vs 283 + 126 us for the two parts).

Supported: fp16 / bf16 (fp32 for tests), any ``block_size`` (16/32/64 tested), head sizes up to
256 (non-powers of two such as 80/96 are padded with masks), any GQA ratio. Rows of ``query`` past
``meta.num_actual_tokens`` come back as zeros, like the reference backend.

This module imports on a machine without Triton; the kernels are imported at the first forward.
"""

from __future__ import annotations

import importlib.util

import torch

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata

HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_available(device: torch.device | str | None = None) -> bool:
    """True when Triton is installed and ``device`` (default: CUDA) is a CUDA device that exists."""
    dev = torch.device(device) if device is not None else torch.device("cuda")
    return HAS_TRITON and dev.type == "cuda" and torch.cuda.is_available()


class TritonBackend(AttentionBackend):
    """Triton paged attention. Stateless: every call reads only its arguments."""

    name = "triton"
    accepts_stored_kv = True

    def __init__(self) -> None:
        if not HAS_TRITON:
            raise ImportError(
                "the 'triton' attention backend needs the triton package (GPU installs have it)"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_stored: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store K/V (unless ``kv_stored``: the fused RoPE kernel did), then attend. ``out`` (optional,
        shaped like ``query``) is written in place and returned: a preallocated buffer for CUDA
        graphs, or a poisoned one in tests."""
        from pagedllm.attention.triton_kernels import kv_store, paged_attention

        if not kv_stored:
            kv_store.store_kv_cache(
                _last_dim_contiguous(key), _last_dim_contiguous(value), kv_cache, meta.slot_mapping
            )
        query = _last_dim_contiguous(query)
        if out is None:
            out = torch.empty_like(query)
        n = meta.num_actual_tokens
        if query.shape[0] > n:
            out[n:].zero_()
        if n == 0 or meta.num_reqs == 0:
            return out
        args = (out, query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
        paged_attention.paged_decode(*args, scale, order=meta.decode_order)  # the query_len == 1 requests
        if meta.max_query_len > 1:
            paged_attention.unified_attention(*args, meta.max_query_len, scale, skip_decodes=True)
        return out


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
