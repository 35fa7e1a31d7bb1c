"""Triton kernels behind the attention boundary (imported only by ``triton_backend``).

Every module here imports ``triton`` at the top, so import them lazily: a CPU-only install
without Triton must still be able to import ``pagedllm.attention.triton_backend``.

- ``kv_store``: write each new token's K/V into its paged-cache slot (slots < 0 skipped).
- ``paged_attention``: the unified ragged-batch kernel (prefill, chunked prefill, decode in one
  launch) and the split-KV decode kernel with its reduce kernel (flash-decoding).
"""
