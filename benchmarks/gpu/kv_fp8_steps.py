"""Where the nano-bench's step time goes with a bf16 and a float8 KV cache, from ``--trace-steps`` files.

For each trace (``bench throughput --trace-steps PATH``: one row per step with its GPU time, batch
shape and context), prints: the GPU time of decode-only steps and of steps with a prefill, the idle
time between steps, the decode time by batch band, the batch sizes reached, and a least-squares fit of the decode-only steps,
``gpu_ms = fixed + per_req * num_reqs + per_kv * kv_tokens``: ``per_kv`` (ms per 100k tokens of
context read) is the attention's cost the cache dtype changes, the rest is what it cannot change
(weights, sampling, launches). Usage: ``python benchmarks/gpu/kv_fp8_steps.py TRACE.json...``
(the file name's ``kv-<dtype>`` part labels the row); writes ``$OUT/kv-fp8-steps.json`` when
``OUT`` is set.
"""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np

# Decode batch bands: up to 32 requests the kernel splits them (latency-bound), then one split each.
BANDS = ((1, 32), (33, 128), (129, 256), (257, 1 << 20))


def summarize(rows: list[dict]) -> dict:
    decode = [r for r in rows if r["num_tokens"] == r["num_decodes"] and r["num_reqs"] > 0]
    mixed = [r for r in rows if r["num_tokens"] != r["num_decodes"]]
    reqs = np.array([r["num_reqs"] for r in decode], dtype=float)
    kv = np.array([r["sum_decode_seq_lens"] for r in decode], dtype=float) / 1e5
    ms = np.array([r["gpu_ms"] for r in decode])
    fit = {}
    if len(decode) >= 3:
        coef, *_ = np.linalg.lstsq(np.stack([np.ones_like(ms), reqs, kv], 1), ms, rcond=None)
        fit = {"fixed_ms": coef[0], "per_req_ms": coef[1], "per_100k_kv_tokens_ms": coef[2],
               "kv_share_of_decode_time": float(coef[2] * kv.sum() / ms.sum())}
    bands = {f"decode_s_batch_{lo}-{hi}": sum(r["gpu_ms"] for r in decode if lo <= r["num_reqs"] <= hi) / 1e3
             for lo, hi in BANDS}
    return {
        "steps": len(rows), "decode_steps": len(decode), "mixed_steps": len(mixed), **bands,
        "decode_gpu_s": ms.sum() / 1e3, "mixed_gpu_s": sum(r["gpu_ms"] for r in mixed) / 1e3,
        "idle_s": sum(r.get("idle_after_ms", 0.0) for r in rows) / 1e3,
        "max_num_reqs": int(reqs.max()) if len(reqs) else 0,
        "mean_decode_batch": float(reqs.mean()) if len(reqs) else 0.0,
        "decode_steps_at_max_batch": int((reqs == reqs.max()).sum()) if len(reqs) else 0,
        "mean_decode_kv_tokens": float(kv.mean() * 1e5) if len(kv) else 0.0,
        "host_launch_ms_mean": float(np.mean([r["host_launch_ms"] for r in rows])),
        **{k: round(float(v), 4) for k, v in fit.items()},
    }


def main(paths: list[str]) -> int:
    table = {}
    for path in paths:
        m = re.search(r"kv-(\w+?)-(\d+)\.json$", os.path.basename(path))
        label = f"{m.group(1)}#{m.group(2)}" if m else os.path.basename(path)
        with open(path) as f:
            table[label] = summarize(json.load(f))
    keys = ["steps", "decode_steps", "decode_gpu_s", *(f"decode_s_batch_{lo}-{hi}" for lo, hi in BANDS), "mixed_gpu_s", "idle_s", "max_num_reqs", "mean_decode_batch",
            "decode_steps_at_max_batch", "mean_decode_kv_tokens", "fixed_ms", "per_req_ms", "per_100k_kv_tokens_ms",
            "kv_share_of_decode_time", "host_launch_ms_mean"]
    print(f"{'':28s}" + "".join(f"{label:>14s}" for label in table))
    for k in keys:
        vals = [t.get(k, float("nan")) for t in table.values()]
        print(f"{k:28s}" + "".join(f"{v:>14,.4g}" if isinstance(v, float) else f"{v:>14}" for v in vals))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kv-fp8-steps.json"), "w") as f:
            json.dump(table, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
