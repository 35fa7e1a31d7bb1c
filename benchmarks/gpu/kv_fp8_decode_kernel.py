"""The split-KV decode kernel on a bf16 cache against a float8 one, at the nano-bench's decode shapes.

A float8 cache halves the bytes a decode step's attention reads, so the kernel should run up to
twice as fast where it is bandwidth-bound; this times ``paged_decode`` alone (CUDA events, median
of repeats) for each cache, kernel variant and launch configuration (key tile, warps, pipeline
stages), and prints the time and effective bandwidth of each and the fp8 / bf16 time ratios.

Variants of the kernel source (built from ``paged_attention.py`` by a textual change, imported as
their own module so each compiles apart):
- ``fp8``: the kernels as they are (V tile upcast by PTX ``cvt``: ``paged_attention._upcast_v_tile``);
- ``fp8/cast``: the V tile upcast by a plain cast (``_PTX`` off), the code before that helper: Triton
  then transposes the 8-bit V tile byte by byte out of shared memory;
(Round 1 on an H100 also tried the K tile through the same helper: 0.07-0.4x slower.)

Shapes (Qwen3-0.6B heads: 16 query, 8 KV, head_dim 128; 16-token blocks, shuffled): ``uniform`` =
``--batch`` requests of ``--ctx`` keys; ``ragged`` = ``--batch`` requests of 100-2048 keys (the
nano-bench's steady state: prompts of 100-1024 tokens plus up to 1024 generated), longest first as
the engine launches them; ``mid`` = 64 requests of 300-2048 keys (one split each); ``tail`` = 16
requests of 600-2048 keys (the run's end: 4 splits each). Then the prefill kernel
(``unified_attention``) on 28 whole prompts of 100-1024 tokens (a 16k-token chunk), bf16 vs fp8.
Usage (GPU machine, repo root):

    python benchmarks/gpu/kv_fp8_decode_kernel.py [--batch 256 --ctx 1000] [--quick]

Writes ``$OUT/kv_fp8_decode_kernel.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from pagedllm.attention.triton_kernels import paged_attention  # noqa: E402

# (variant, cache) -> configs (tile_n, warps, stages); None: the kernel's default (``decode_config``).
CONFIGS = {
    ("bf16", "bf16"): [None, (64, 2, 4), (128, 2, 3)],
    ("fp8", "fp8_e4m3"): [None, (64, 2, 3), (64, 2, 5), (64, 4, 5), (32, 2, 5), (128, 4, 3), (128, 4, 5)],
    ("fp8/cast", "fp8_e4m3"): [(64, 2, 3), (64, 2, 5)],
}
EDITS = {
    "fp8/cast": [("_PTX = tl.constexpr(not triton.knobs.runtime.interpret)", "_PTX = tl.constexpr(False)")],
}


def _variant_module(name: str):
    """``paged_attention`` with the variant's edits, imported from a temporary file (None if an edit's
    text is no longer in the source)."""
    if name not in EDITS:
        return paged_attention
    src = inspect.getsource(paged_attention)
    for old, new in EDITS[name]:
        if old not in src:
            return None
        src = src.replace(old, new)
    path = Path(tempfile.mkdtemp()) / f"paged_attention_{name.replace('/', '_').replace('-', '_')}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _time_ms(fn, iters: int = 40) -> float:
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


def _shape(name: str, seq_lens: list[int], ns, dev) -> dict:
    """Query, shuffled block tables and a bf16 cache for ``seq_lens`` (longest first, as the engine
    launches them); the float8 caches are its rounded copies."""
    bs, n = ns.block_size, len(seq_lens)
    nblk = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(nblk) + 1
    cache = torch.randn((2, num_blocks, bs, ns.kv_heads, ns.head_dim), dtype=torch.bfloat16, device=dev) * 0.5
    perm = (torch.randperm(num_blocks - 1, device=dev) + 1).to(torch.int32)
    tables = torch.zeros(n, max(nblk), dtype=torch.int32, device=dev)
    used = 0
    for r, b in enumerate(nblk):
        tables[r, :b] = perm[used: used + b]
        used += b
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    return {"name": name, "seq_lens": seq_lens, "cache": cache, "tables": tables, "lens": lens,
            "order": torch.argsort(lens, descending=True).to(torch.int32),
            "qsl": torch.arange(n + 1, dtype=torch.int32, device=dev),
            "query": torch.randn(n, ns.heads, ns.head_dim, dtype=torch.bfloat16, device=dev)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=1000)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="default configs only")
    ap.add_argument("--shapes", default="", help="comma list of the decode shapes to run (default: all)")
    ns = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rng = random.Random(0)
    shapes = [_shape("uniform", [ns.ctx] * ns.batch, ns, dev),
              _shape("ragged", [rng.randint(100, 2048) for _ in range(ns.batch)], ns, dev),
              _shape("mid", [rng.randint(300, 2048) for _ in range(64)], ns, dev),
              _shape("tail", [rng.randint(600, 2048) for _ in range(16)], ns, dev)]
    if ns.shapes:
        shapes = [s for s in shapes if s["name"] in ns.shapes.split(",")]
    scale = ns.head_dim ** -0.5
    rows = []
    for (variant, cache_name), configs in CONFIGS.items():
        mod = _variant_module(variant)
        if mod is None:
            print(f"variant {variant}: its edit no longer applies; skipped")
            continue
        for shp in shapes:
            cache = shp["cache"] if cache_name == "bf16" else shp["cache"].to(_fp8_dtype(cache_name))
            out = torch.empty_like(shp["query"])
            kv_bytes = 2 * sum(shp["seq_lens"]) * ns.kv_heads * ns.head_dim * cache.element_size()
            for config in configs[:1] if ns.quick else configs:
                splits = mod.decode_num_splits(len(shp["seq_lens"]), ns.kv_heads, mod._num_sms(dev))
                tile_n, warps, stages = config or mod.decode_config(cache.element_size(), splits)
                def run(mod=mod, cache=cache, shp=shp, out=out, tile_n=tile_n, warps=warps, stages=stages):
                    mod.paged_decode(out, shp["query"], cache, shp["tables"], shp["lens"], shp["qsl"], scale,
                                     tile_n=tile_n, num_warps=warps, num_stages=stages, order=shp["order"])
                row = {"variant": variant, "cache": cache_name, "shape": shp["name"], "tile_n": tile_n,
                       "warps": warps, "stages": stages, "default": config is None, "splits": splits}
                try:
                    ms = _time_ms(run)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported
                    rows.append(dict(row, error=str(exc)[:160]))
                    continue
                rows.append(dict(row, ms=ms, tb_per_s=kv_bytes / ms / 1e9))
            del cache
    prefill = _prefill_rows(ns, dev, rng) if not ns.shapes or "prefill" in ns.shapes else []
    _report(rows, shapes, ns, prefill)
    return 0


def _prefill_rows(ns, dev, rng) -> list[dict]:
    """``unified_attention`` (the prefill kernel, default configuration) on 28 whole prompts of
    100-1024 tokens, for each cache and variant."""
    from benchmarks.kernels.bench_attention import Batch

    lens = [rng.randint(100, 1024) for _ in range(28)]
    batch = Batch(lens, lens, block_size=ns.block_size, num_heads=ns.heads, num_kv_heads=ns.kv_heads,
                  head_dim=ns.head_dim)
    q, _, _, meta, out = batch.sets[0]
    rows = []
    for variant, cache_name in (("bf16", "bf16"), ("fp8", "fp8_e4m3"), ("fp8/cast", "fp8_e4m3")):
        mod = _variant_module(variant)
        cache = batch.kv_cache if cache_name == "bf16" else batch.kv_cache.to(_fp8_dtype(cache_name))
        def run(mod=mod, cache=cache):
            mod.unified_attention(out, q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                  max(lens), batch.scale)
        rows.append({"variant": variant, "tokens": sum(lens), "ms": _time_ms(run)})
    print(f"\nprefill (unified_attention, 28 prompts of 100-1024 tokens, {sum(lens)} tokens):")
    for r in rows:
        print(f"  {r['variant']:10s} {r['ms']:.4f} ms  ({r['ms'] / rows[0]['ms']:.3f} of bf16)")
    return rows


def _fp8_dtype(cache_name: str) -> torch.dtype:
    return {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[cache_name]


def _report(rows: list[dict], shapes: list[dict], ns, prefill: list[dict]) -> None:
    print("| variant | shape | splits | tile_n | warps | stages | ms | TB/s |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']}{' (default)' if r.get('default') else ''} | {r['shape']} | {r['splits']} | "
              f"{r['tile_n']} | {r['warps']} | {r['stages']} | {r.get('ms', float('nan')):.4f} | "
              f"{r.get('tb_per_s', float('nan')):.2f} |" + (f" {r['error']}" if "error" in r else ""))
    ok = [r for r in rows if "ms" in r]
    summary = {}
    print("\nfp8 / bf16 time (each one's default config; best config of each):")
    for shp in (s["name"] for s in shapes):
        base = [r for r in ok if r["variant"] == "bf16" and r["shape"] == shp]
        if not base:
            continue
        b_def = next((r["ms"] for r in base if r["default"]), None)
        b_best = min(r["ms"] for r in base)
        for variant in dict.fromkeys(r["variant"] for r in ok if r["variant"] != "bf16"):
            mine = [r for r in ok if r["variant"] == variant and r["shape"] == shp]
            if not mine:
                continue
            d = next((r for r in mine if r["default"]), None)
            best = min(mine, key=lambda r: r["ms"])
            entry = {"default_ratio": d["ms"] / b_def if d and b_def else None, "best_ratio": best["ms"] / b_best,
                     "best_config": [best["tile_n"], best["warps"], best["stages"]], "best_ms": best["ms"],
                     "splits": best["splits"]}
            summary[f"{shp}/{variant}"] = entry
            print(f"  {shp:8s} {variant:10s} default {entry['default_ratio'] or float('nan'):.3f}"
                  f"  best {entry['best_ratio']:.3f} at {best['tile_n']}/{best['warps']}/{best['stages']}"
                  f" ({best['tb_per_s']:.2f} TB/s; bf16 default {b_def or float('nan'):.4f} ms, best {b_best:.4f} ms)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kv_fp8_decode_kernel.json"), "w") as f:
            json.dump({"args": vars(ns), "device": torch.cuda.get_device_name(), "rows": rows, "summary": summary,
                       "prefill": prefill}, f, indent=2)


if __name__ == "__main__":
    raise SystemExit(main())
