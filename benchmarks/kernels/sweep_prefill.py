"""Sweep the unified (prefill) attention kernel's launch parameters on a nano-bench-like prefill
chunk (GPU only).

The nano-bench prefills 256 prompts of 100-1024 tokens in chunks of 16,384 tokens; one chunk is
~23 whole prompts. This times ``paged_attention.unified_attention`` on such a chunk (Qwen3-0.6B
heads unless ``--heads``, block size 16, L2 flushed between calls) for every combination of query-tile height
(``block_m`` rows = query tokens x query heads per KV head), key tile, warps and pipelining
stages, and prints causal TFLOP/s.

Usage (repo root, on the device): ``python benchmarks/kernels/sweep_prefill.py [--out FILE]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--block-m", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--tiles", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--heads", type=int, nargs=2, default=[16, 8], metavar=("Q", "KV"),
                    help="query and KV heads (head_dim 128): Qwen3-0.6B 16 8, Llama-3.1-8B 32 8")
    ns = ap.parse_args()
    from benchmarks.kernels.bench_attention import Batch, time_us  # noqa: PLC0415

    rng = random.Random(0)
    lens: list[int] = []
    while sum(lens) < ns.tokens:
        lens.append(min(rng.randint(*ns.prompt_range), ns.tokens - sum(lens)))
    batch = Batch(lens, lens, sets=1, block_size=16, num_heads=ns.heads[0], num_kv_heads=ns.heads[1], head_dim=128)
    flops = batch.attn_flops()
    print(f"heads {ns.heads}: {len(lens)} prompts of {ns.prompt_range}, {sum(lens)} tokens, {flops / 1e9:.1f} GFLOP of causal attention")
    rows = []
    default_us = time_us(batch.fn("unified"), graph=False)
    print(f"default: {default_us:8.1f} us {flops / default_us / 1e6:6.1f} TFLOP/s")
    for block_m, tile_n, warps, stages in itertools.product(ns.block_m, ns.tiles, ns.warps, ns.stages):
        kw = dict(block_m=block_m, tile_n=tile_n, num_warps=warps, num_stages=stages)
        try:
            us = time_us(batch.fn("unified", **kw), graph=False)
        except Exception as e:  # noqa: BLE001 (a config out of resources is a note, not a failure)
            print(f"{kw}: {e!r:.100}")
            continue
        rows.append(dict(kw, us=us, tflops=flops / us / 1e6))
        print(f"{kw}: {us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s")
    best = min(rows, key=lambda r: r["us"])
    print(f"best {best}; default {default_us:.1f} us")
    if ns.out:
        Path(ns.out).write_text(json.dumps(dict(prompts=lens, default_us=default_us, rows=rows), indent=1))


if __name__ == "__main__":
    main()
