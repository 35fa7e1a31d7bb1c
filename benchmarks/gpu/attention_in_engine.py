"""Time the split-KV decode kernel on the engine's own KV cache and metadata, against the same
sequence lengths over a small standalone cache (``benchmarks/kernels/bench_attention.Batch``).

Question it answers: does the decode kernel reach the same bandwidth inside the engine (one
large per-layer cache, blocks handed out by the block pool) as in the kernel sweeps? Run from the
repo root on the device: ``python benchmarks/gpu/attention_in_engine.py [BATCH [CONTEXT [KV_CACHE_DTYPE]]]``
(``KV_CACHE_DTYPE`` auto or fp8: the standalone cache is then the same float8 format).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.gpu.decode_setup import decoding_engine  # noqa: E402
from benchmarks.kernels.bench_attention import Batch, time_us  # noqa: E402
from pagedllm.attention.triton_kernels import paged_attention  # noqa: E402

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 128
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
kv_cache_dtype = sys.argv[3] if len(sys.argv) > 3 else "auto"
_, engine = decoding_engine(batch, ctx, kv_cache_dtype=kv_cache_dtype)
runner = engine.engine_core.runner
torch.cuda.synchronize()
gr = runner.graph_runner
bs = gr.padded_size(batch)
meta = gr.metadata(bs)
seq_lens = meta.seq_lens[:batch].tolist()
kv = runner.kv_caches[0]
q = torch.randn(bs, 16, 128, device="cuda", dtype=runner.dtype)
out = torch.empty_like(q)
kv_bytes = sum(seq_lens) * 8 * 128 * 2 * kv.element_size()
print(f"{kv.dtype} cache, batch {batch} (graph {bs}) ctx {min(seq_lens)}-{max(seq_lens)}; layer cache {tuple(kv.shape)} "
      f"{kv.numel() * kv.element_size() / 2**30:.1f} GiB; KV read per layer {kv_bytes / 1e6:.0f} MB")
tables = meta.block_tables[:batch]
print("block table rows 0-1, first 6:", tables[:2, :6].tolist(), " max block id", int(tables.max()))
standalone = Batch(seq_lens, [1] * batch, sets=8, block_size=kv.shape[2], num_heads=16, num_kv_heads=8, head_dim=128)
standalone.kv_cache = standalone.kv_cache.to(kv.dtype)  # the engine's format (a float8 cache: rounded)
src = torch.empty(512 * 2**20, device="cuda", dtype=torch.bfloat16)
dst = torch.empty_like(src)
copy_gbps = 2 * src.numel() * 2 / time_us(lambda: dst.copy_(src), graph=True) / 1e3
print(f"copy (read + write): {copy_gbps:.0f} GB/s")
configs = [dict(), dict(tile_n=32, num_warps=2, num_stages=2), dict(tile_n=64, num_warps=4, num_stages=3),
           dict(tile_n=64, num_warps=2, num_stages=2), dict(tile_n=32, num_warps=4, num_stages=3)]
order = meta.decode_order[:batch] if meta.decode_order is not None else None
for kw in configs:
    def engine_fn(kw=kw):
        paged_attention.paged_decode(out[:batch], q[:batch], kv, tables, meta.seq_lens[:batch],
                                     meta.query_start_loc[: batch + 1], 0.088, order=order, **kw)
    e_us = time_us(engine_fn, graph=True)
    s_us = time_us(standalone.fn("decode", **kw), graph=True)
    print(f"{str(kw) or 'default':55s} engine cache {e_us:7.1f} us {kv_bytes / e_us / 1e3:6.0f} GB/s | "
          f"standalone {s_us:7.1f} us {kv_bytes / s_us / 1e3:6.0f} GB/s")
