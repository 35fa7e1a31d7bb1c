"""GPU attention backend: Triton kernels for the KV store and paged attention.

``TritonBackend.forward`` does what the base class documents (``backend.py``): store the new K/V at
``meta.slot_mapping`` (slots < 0 are padding and skipped), then attend over the paged cache.

Dispatch (cost per layer): one KV-store launch, then
- the split-KV decode kernel plus its reduce kernel (``paged_attention.paged_decode``) for the
  requests with ``query_len == 1``; its programs for other requests exit at once. No host sync and
  a launch grid that depends only on ``num_reqs`` and constants, so a pure decode batch
  (``meta.max_query_len == 1``: nothing else is launched) can be captured in a CUDA graph at a
  padded batch size;
- when every request has at most a few queries (``short_query_attention.fits``: speculative
  verification, short chunks), the split-KV kernel of ``short_query_attention`` and its reduce
  kernel for the requests with ``query_len > 1`` (the unified kernel would give each request and
  KV head one program walking the whole context);
- else, when ``meta.max_query_len > 1``, one launch of the unified ragged kernel
  (``paged_attention.unified_attention(skip_decodes=True)``) for prefill, chunked prefill with a
  cached prefix, and any other ``query_len > 1`` request. Splitting a mixed batch this way keeps
  decodes off the tall prefill tiles (two launches beat one unified launch on mixed steps;
  benchmarks/kernels/bench_attention.py measures both).

Supported: fp16 / bf16 (fp32 for tests) caches, or a float8 cache (``kv_cache_dtype="fp8*"``:
stored saturating, upcast to the query's dtype as each tile is loaded), any ``block_size`` (16/32/64 tested), head sizes up to
256 (non-powers of two such as 80/96 are padded with masks), any GQA ratio. Rows of ``query`` past
``meta.num_actual_tokens`` come back as zeros, like the reference backend.

This module imports on a machine without Triton; the kernels are imported at the first forward.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from pagedllm.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionInputs,
    KVWriter,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None

# Prefill lengths of the warm-up: each picks another tile height of the unified kernel
# (``paged_attention.unified_attention``: ``block_m = min(64, max(16, next_pow2(max_query_len * qpk)))``).
_WARMUP_PREFILL_LENS = (2, 4, 8, 16, 32, 64)


def triton_available(device: torch.device | str | None = None) -> bool:
    """True when Triton is installed and ``device`` (default: CUDA) is a CUDA device that exists."""
    dev = torch.device(device) if device is not None else torch.device("cuda")
    return HAS_TRITON and dev.type == "cuda" and torch.cuda.is_available()


@dataclass
class TritonMetadata(AttentionMetadata):
    """The common fields plus ``decode_order``: an optional int32 [num_reqs] permutation of the
    requests, longest seq_len first, in which the decode kernel starts them (load balance at large
    batch). It changes no result."""

    decode_order: torch.Tensor | None = None


class TritonMetadataBuilder(AttentionMetadataBuilder):
    """Copies the common fields and takes the staged longest-first order. No host or device work."""

    def build(self, common: CommonAttentionInputs) -> TritonMetadata:
        return TritonMetadata(common.num_actual_tokens, common.max_query_len, common.query_start_loc,
                              common.seq_lens, common.block_tables, common.slot_mapping,
                              decode_order=common.longest_first)


def _store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    from pagedllm.attention.triton_kernels import kv_store

    kv_store.store_kv_cache(_last_dim_contiguous(key), _last_dim_contiguous(value), kv_cache, slot_mapping)


class TritonBackend(AttentionBackend):
    """Triton paged attention. Stateless: every call reads only its arguments."""

    name = "triton"
    metadata_builder = TritonMetadataBuilder()
    kv_writer = KVWriter(layout="NHD", store=_store_kv)
    supports_decode_graphs = True
    uses_longest_first_order = True

    def __init__(self) -> None:
        if not HAS_TRITON:
            raise ImportError(
                "the 'triton' attention backend needs the triton package (GPU installs have it)"
            )

    def warmup_query_lens(self, max_query_len: int) -> list[list[int]]:
        """1 and 2 decodes (the eager decode kernel, the small-M GEMV), then one decode plus one
        prefill of each tile-height length; mixes longer than ``max_query_len`` are left out."""
        mixes = [[1], [1, 1]] + [[1, n] for n in _WARMUP_PREFILL_LENS]
        return [m for m in mixes if max(m) <= max_query_len]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: TritonMetadata,
        scale: float,
        kv_stored: bool = False,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store K/V (unless ``kv_stored``: the fused RoPE kernel did), then attend (with the layer's
        sliding window and logit soft cap, compile-time constants of the kernels). ``out`` (optional,
        shaped like ``query``) is written in place and returned: a preallocated buffer for CUDA
        graphs, or a poisoned one in tests."""
        from pagedllm.attention.triton_kernels import paged_attention, short_query_attention

        if not kv_stored:
            _store_kv(key, value, kv_cache, meta.slot_mapping)
        query = _last_dim_contiguous(query)
        if out is None:
            out = torch.empty_like(query)
        n = meta.num_actual_tokens
        if query.shape[0] > n:
            out[n:].zero_()
        if n == 0 or meta.num_reqs == 0:
            return out
        args = (out, query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
        options = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}
        paged_attention.paged_decode(*args, scale, order=meta.decode_order, **options)  # query_len == 1
        if meta.max_query_len > 1:
            if short_query_attention.fits(meta.max_query_len, query.shape[1] // kv_cache.shape[3]):
                short_query_attention.short_query_attention(*args, meta.max_query_len, scale, **options)
            else:
                paged_attention.unified_attention(*args, meta.max_query_len, scale, skip_decodes=True, **options)
        return out


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
