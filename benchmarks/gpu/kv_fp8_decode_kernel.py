"""The split-KV decode kernel on a bf16 cache against a float8 one, at the nano-bench's decode shape.

A float8 cache halves the bytes a decode step's attention reads, so the kernel should run up to
twice as fast where it is bandwidth-bound; this times ``paged_decode`` alone (CUDA events, median
of repeats) for both caches and a few launch configurations (key tile, warps, pipeline stages),
and prints the effective bandwidth of each. Usage (GPU machine, repo root):

    python benchmarks/gpu/kv_fp8_decode_kernel.py [--batch 256 --ctx 1000 --heads 16 --kv-heads 8]

Writes ``$OUT/kv_fp8_decode_kernel.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from pagedllm.attention.triton_kernels import paged_attention


def _time_ms(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=1000)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ns = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    blocks_per_req = -(-ns.ctx // ns.block_size)
    num_blocks = ns.batch * blocks_per_req + 1
    shape = (2, num_blocks, ns.block_size, ns.kv_heads, ns.head_dim)
    cache_bf16 = torch.randn(shape, dtype=torch.bfloat16, device=dev) * 0.5
    fp8 = cache_bf16.to(torch.float8_e4m3fn)
    # "fp8_e4m3/bf16-dots": the upcast to the query's bfloat16 that the kernel used before.
    caches = {"bf16": cache_bf16, "fp8_e4m3": fp8, "fp8_e4m3/bf16-dots": fp8}
    query = torch.randn(ns.batch, ns.heads, ns.head_dim, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(query)
    perm = torch.randperm(num_blocks - 1, device=dev)[: ns.batch * blocks_per_req] + 1
    block_tables = perm.view(ns.batch, blocks_per_req).to(torch.int32)
    seq_lens = torch.full((ns.batch,), ns.ctx, dtype=torch.int32, device=dev)
    qsl = torch.arange(ns.batch + 1, dtype=torch.int32, device=dev)
    scale = ns.head_dim ** -0.5
    rows = []
    configs = [(64, 2, 3)] + [c for c in itertools.product((32, 64, 128), (2, 4), (2, 3, 4)) if c != (64, 2, 3)]
    new_dtype = paged_attention._compute_dtype
    for name, cache in caches.items():
        paged_attention._compute_dtype = (lambda q, c: q.dtype) if name.endswith("bf16-dots") else new_dtype
        kv_bytes = 2 * ns.batch * ns.ctx * ns.kv_heads * ns.head_dim * cache.element_size()
        for tile_n, warps, stages in configs:
            def run(cache=cache, tile_n=tile_n, warps=warps, stages=stages):
                paged_attention.paged_decode(out, query, cache, block_tables, seq_lens, qsl, scale,
                                             tile_n=tile_n, num_warps=warps, num_stages=stages)
            try:
                ms = _time_ms(run)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported
                rows.append({"cache": name, "tile_n": tile_n, "warps": warps, "stages": stages, "error": str(exc)[:120]})
                continue
            rows.append({"cache": name, "tile_n": tile_n, "warps": warps, "stages": stages, "ms": ms,
                         "tb_per_s": kv_bytes / ms / 1e9})
    print("| cache | tile_n | warps | stages | ms | TB/s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cache']} | {r['tile_n']} | {r['warps']} | {r['stages']} | {r.get('ms', float('nan')):.4f} | "
              f"{r.get('tb_per_s', float('nan')):.2f} |")
    best = {n: min((r for r in rows if r["cache"] == n and "ms" in r), key=lambda r: r["ms"]) for n in caches}
    default = {n: next(r for r in rows if r["cache"] == n and (r["tile_n"], r["warps"], r["stages"]) == (64, 2, 3))
               for n in caches}
    paged_attention._compute_dtype = new_dtype
    print(f"default config: fp8 / bf16 time = {default['fp8_e4m3']['ms'] / default['bf16']['ms']:.3f} "
          f"(with bf16 dots {default['fp8_e4m3/bf16-dots']['ms'] / default['bf16']['ms']:.3f}); "
          f"best fp8 {best['fp8_e4m3']} vs best bf16 {best['bf16']}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kv_fp8_decode_kernel.json"), "w") as f:
            json.dump({"args": vars(ns), "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
