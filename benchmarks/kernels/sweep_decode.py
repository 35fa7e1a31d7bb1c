"""Sweep the split-KV decode kernel's launch parameters (GPU only).

At batch 1-16 a decode step's attention is a few microseconds of latency: the split length
(``min_split_len``), the key tile and the warps decide it. At batch 64-256 it is a stream of the
whole KV cache (the 8B model at batch 64 and ~1150 keys reads 302 MB per layer), and what matters is
how close it gets to copy bandwidth: warps, pipelining stages and the number of splits.
Times ``paged_attention.paged_decode`` (split + reduce) inside CUDA graphs over 8 disjoint input
sets (so one call's KV is not in L2 for the next), for Qwen3-0.6B and Llama-3.1-8B head shapes.

Usage (repo root):
  small batch: ``python benchmarks/kernels/sweep_decode.py --out sweep.json``
  large batch: ``python benchmarks/kernels/sweep_decode.py --models llama-3.1-8b --batches 64
  --contexts 1152 --min-splits 64 --tiles 32 64 128 --warps 2 4 8 --stages 2 3 4 --splits 0 1 2 4``
  ragged batch (the nano-bench's mix of lengths), with and without the longest-first launch order:
  ``python benchmarks/kernels/sweep_decode.py --models qwen3-0.6b --batches 128 256 --ragged 200 2048
  --min-splits 64 --tiles 32 64 --warps 2 4 --stages 2 3 --orders none longest``
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = {"qwen3-0.6b": dict(num_heads=16, num_kv_heads=8, head_dim=128),
          "llama-3.1-8b": dict(num_heads=32, num_kv_heads=8, head_dim=128)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 4096])
    ap.add_argument("--min-splits", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--tiles", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--stages", type=int, nargs="+", default=[3])
    ap.add_argument("--splits", type=int, nargs="+", default=[0], help="0: the kernel's own choice")
    ap.add_argument("--ragged", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                    help="context lengths uniform in [LO, HI] (seeded) instead of --contexts")
    ap.add_argument("--orders", nargs="+", default=["none"], choices=["none", "longest"],
                    help="launch order of the requests: as given, or longest seq_len first")
    ap.add_argument("--layouts", nargs="+", default=["nhd"], choices=["nhd", "hnd"],
                    help="KV block layout: [block, heads, dim] (the engine's) or [heads, block, dim]")
    ns = ap.parse_args()
    import torch  # noqa: PLC0415

    from benchmarks.kernels.bench_attention import Batch, time_us  # noqa: PLC0415

    rows = []
    grid = list(itertools.product(ns.min_splits, ns.tiles, ns.warps, ns.stages, ns.splits, ns.orders))
    contexts = ["ragged"] if ns.ragged else ns.contexts
    for name, batch, ctx, layout in itertools.product(ns.models, ns.batches, contexts, ns.layouts):
        if ns.ragged:
            rng = random.Random(0)
            lens = [rng.randint(*ns.ragged) for _ in range(batch)]
            ctx = f"{ns.ragged[0]}-{ns.ragged[1]}"
        else:
            lens = [ctx] * batch
        b = Batch(lens, [1] * batch, sets=8, block_size=16, layout=layout, **SHAPES[name])
        longest_first = torch.tensor(sorted(range(batch), key=lambda r: -lens[r]), dtype=torch.int32, device="cuda")
        kv_bytes = b.kv_bytes()

        def gbps(us: float, kv_bytes: int = kv_bytes) -> float:
            return kv_bytes / us / 1e3

        best = None
        for min_split, tile_n, warps, stages, splits, order in grid:
            kw = dict(min_split_len=min_split, tile_n=tile_n, num_warps=warps, num_stages=stages,
                      num_splits=splits or None)
            order_kw = {"order": longest_first} if order == "longest" else {}
            try:
                us = time_us(b.fn("decode", **kw, **order_kw), graph=True)
            except Exception as e:  # noqa: BLE001 (a config out of resources is a note, not a failure)
                print(f"{name} b{batch} ctx{ctx} {kw}: {e!r:.120}")
                continue
            kw["order"] = order
            rows.append(dict(model=name, batch=batch, ctx=ctx, layout=layout, us=us, gbps=gbps(us), **kw))
            print(f"  {name} b{batch} ctx{ctx} {layout} {kw}: {us:8.2f} us {gbps(us):6.0f} GB/s")
            if best is None or us < best[0]:
                best = (us, kw)
        default_us = time_us(b.fn("decode"), graph=True)
        rows.append(dict(model=name, batch=batch, ctx=ctx, layout=layout, us=default_us, gbps=gbps(default_us),
                         default=True))
        print(f"{name:13s} b{batch:<3d} ctx{ctx!s:<5s} {layout} default {default_us:8.2f} us {gbps(default_us):6.0f} GB/s | "
              f"best {best[0]:8.2f} us {gbps(best[0]):6.0f} GB/s {best[1]}")
        del b
        torch.cuda.empty_cache()
    if ns.out:
        Path(ns.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
