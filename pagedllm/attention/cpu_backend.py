"""The CPU backend: decode attention by the native kernel that reads K/V in place from the pages.

Prefill and chunked prefill go through the reference (one SDPA call per request, where the GEMMs
dominate and a gather is cheap next to them). Decode requests (query_len 1), and the queries of
requests with a few (``SHORT_QUERY_LEN``: speculative verification), go to
``native.kernels.paged_decode_attention`` in one call per layer, which reads each cached key and value
once instead of gathering them into a padded copy first; a float8 cache (``kv_cache_dtype="fp8*"``)
is upcast inside the kernel. Where that kernel cannot run (no C compiler, or a query or cache dtype
it does not take) the whole step falls back to the reference path, and so do the layers with a
sliding window or a logit soft cap (the native kernel attends over the whole context with plain
scores; the reference gathers only the window and caps the scores).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.torch_ref import (
    HostPlannedMetadata,
    TorchRefBackend,
    prefill_attention_ref,
    store_kv_cache,
)
from pagedllm.native import kernels as cpu_kernels

# Requests with at most this many queries (speculative verification: 1 + k tokens; short prefill
# chunks) go to the decode kernel as that many single-query rows, query j over the first
# ``seq_len - query_len + j + 1`` keys: it reads each key in place once per query, where the
# reference would gather the whole context into a copy for one SDPA call per request.
SHORT_QUERY_LEN = 16


class DecodeRows:
    """One step's single-query rows as the kernel takes them, built at the first layer and reused by
    the others: ``query_rows`` (query row of each), ``table_rows`` (its block-table row),
    ``seq_lens`` (its context length, its own position included), all int64 ``[num_decodes]``: one
    row per query of every request with 1 to ``SHORT_QUERY_LEN`` queries. ``has_prefill``: some
    request has more (the reference attends those)."""

    def __init__(self, meta: HostPlannedMetadata) -> None:
        qsl, lens = np.asarray(meta.query_start_loc_cpu, dtype=np.int64), np.asarray(meta.seq_lens_cpu, dtype=np.int64)
        query_lens = np.diff(qsl)
        reqs = np.flatnonzero((query_lens >= 1) & (query_lens <= SHORT_QUERY_LEN))
        counts = query_lens[reqs]
        local = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        self.num_decodes = len(local)
        self.has_prefill = bool((query_lens > SHORT_QUERY_LEN).any())
        self.query_rows = torch.from_numpy(np.repeat(qsl[reqs], counts) + local)
        self.table_rows = torch.from_numpy(np.repeat(reqs, counts))
        self.seq_lens = torch.from_numpy(np.repeat(lens[reqs] - counts, counts) + local + 1)


class CpuBackend(TorchRefBackend):
    """The default backend on the CPU (see the module doc); the reference stays available as
    ``attention_backend="torch_ref"``."""

    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self._rows_meta: HostPlannedMetadata | None = None
        self._rows: DecodeRows | None = None

    def forward(self, query, key, value, kv_cache, meta, scale, kv_stored=False, sliding_window=None,
                logits_soft_cap=None):
        if (kv_stored or sliding_window is not None or logits_soft_cap is not None
                or not cpu_kernels.decode_applies(query, kv_cache)):
            return super().forward(query, key, value, kv_cache, meta, scale, kv_stored, sliding_window,
                                   logits_soft_cap)
        n = meta.num_actual_tokens
        if (kv_cache.dtype == torch.float32 and key.stride(-1) == value.stride(-1) == 1
                and key.stride(-2) == value.stride(-2) == key.shape[-1]):
            cpu_kernels.store_kv_cache(key[:n], value[:n], kv_cache, meta.slot_mapping[:n])
        else:  # a float8 cache: the reference's saturating cast
            store_kv_cache(key[:n], value[:n], kv_cache, meta.slot_mapping[:n])
        if self._rows_meta is not meta:
            self._rows_meta, self._rows = meta, DecodeRows(meta)
        rows = self._rows
        query = query.contiguous()
        # Rows past the actual tokens (padding) stay zero; when the kernel writes every row, no fill.
        every_row = not rows.has_prefill and rows.num_decodes == query.shape[0]
        out = torch.empty_like(query) if every_row else torch.zeros_like(query)
        if rows.num_decodes:
            cpu_kernels.paged_decode_attention(query, kv_cache, out, meta.block_tables, rows.query_rows,
                                               rows.table_rows, rows.seq_lens, scale)
        if rows.has_prefill:
            prefill_attention_ref(query[:n], kv_cache, meta, scale, out, min_query_len=SHORT_QUERY_LEN + 1)
        return out
