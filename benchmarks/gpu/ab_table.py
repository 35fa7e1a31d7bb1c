"""Summarise an ``ab_compare.sh`` run: one row per tree, the nano-bench runs and the latency steps,
and the new/base ratios. Writes ``ab-summary.json`` beside the runs and prints a table."""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys


def _nano(outdir: str, label: str) -> list[dict]:
    runs = []
    for path in sorted(glob.glob(os.path.join(outdir, f"nano-{label}-*", "*.json"))):
        with open(path) as f:
            d = json.load(f)
        runs.append({"seconds": d["seconds"], "tok_s": d["output_tokens_per_s"], "startup_s": d["startup_s"],
                     "fraction_of_floor": d["fraction_of_floor"], "commit": d.get("commit")})
    return runs


def _latency(outdir: str, label: str) -> dict:
    out = {}
    for name in ("8b", "0.6b"):
        path = os.path.join(outdir, f"latency-{name}-{label}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            d = json.load(f)
        for run in d["runs"]:
            out[f"{name} b{run['batch_size']} ms"] = run["decode_step_ms"]
        out[f"{name} startup s"] = d["startup_s"]
    return out


def main(outdir: str) -> None:
    summary = {}
    for label in ("base", "new"):
        nano = _nano(outdir, label)
        summary[label] = {"nano_runs": nano, "latency": _latency(outdir, label)}
        if nano:
            summary[label]["nano_median_s"] = statistics.median(r["seconds"] for r in nano)
            summary[label]["nano_startup_median_s"] = statistics.median(r["startup_s"] for r in nano)
    with open(os.path.join(outdir, "ab-summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    keys = ["nano_median_s", "nano_startup_median_s"]
    lat_keys = sorted(set(summary["base"]["latency"]) | set(summary["new"]["latency"]))
    print(f"{'metric':28s} {'base':>10s} {'new':>10s} {'new/base':>9s}")
    for key in keys + lat_keys:
        b = summary["base"].get(key, summary["base"]["latency"].get(key))
        n = summary["new"].get(key, summary["new"]["latency"].get(key))
        ratio = f"{n / b:9.3f}" if b and n else "        -"
        print(f"{key:28s} {b if b is not None else float('nan'):10.4f} {n if n is not None else float('nan'):10.4f} {ratio}")
    for label in ("base", "new"):
        print(label, "nano runs (s):", [round(r["seconds"], 3) for r in summary[label]["nano_runs"]])


if __name__ == "__main__":
    main(sys.argv[1])
