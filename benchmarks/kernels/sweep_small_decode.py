"""Sweep the split-KV decode kernel's launch parameters at small batch (GPU only).

At batch 1-16 a decode step's attention is a few microseconds of latency, not bandwidth: the split
length (``min_split_len``: how many keys one program walks), the key tile and the warps decide it.
Times ``paged_attention.paged_decode`` (split + reduce) inside CUDA graphs over 8 disjoint input
sets (so one call's KV is not in L2 for the next), for Qwen3-0.6B and Llama-3.1-8B head shapes.

Usage (repo root): ``python benchmarks/kernels/sweep_small_decode.py --out sweep.json``
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = {"qwen3-0.6b": dict(num_heads=16, num_kv_heads=8, head_dim=128),
          "llama-3.1-8b": dict(num_heads=32, num_kv_heads=8, head_dim=128)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 4096])
    ns = ap.parse_args()
    import torch  # noqa: PLC0415

    from benchmarks.kernels.bench_attention import Batch, time_us  # noqa: PLC0415

    rows = []
    grid = list(itertools.product([32, 64, 128, 256], [32, 64], [2, 4]))
    for (name, shape), batch, ctx in itertools.product(SHAPES.items(), ns.batches, ns.contexts):
        b = Batch([ctx] * batch, [1] * batch, sets=8, block_size=16, **shape)
        best = None
        for min_split, tile_n, warps in grid:
            kw = dict(min_split_len=min_split, tile_n=tile_n, num_warps=warps)
            try:
                us = time_us(b.fn("decode", **kw), graph=True)
            except Exception as e:  # noqa: BLE001 (a config out of resources is a note, not a failure)
                print(f"{name} b{batch} ctx{ctx} {kw}: {e!r:.120}")
                continue
            rows.append(dict(model=name, batch=batch, ctx=ctx, us=us, **kw))
            if best is None or us < best[0]:
                best = (us, kw)
        default_us = time_us(b.fn("decode"), graph=True)
        rows.append(dict(model=name, batch=batch, ctx=ctx, us=default_us, default=True))
        print(f"{name:13s} b{batch:<3d} ctx{ctx:<5d} default {default_us:6.2f} us | best {best[0]:6.2f} us {best[1]}")
        del b
        torch.cuda.empty_cache()
    if ns.out:
        Path(ns.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
