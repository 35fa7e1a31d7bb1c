"""The nano-bench on a float8 KV cache with the decode kernel's launch configurations that
``kv_fp8_decode_kernel.py`` measured best, to check a sweep's choice at the step level before
making it the default (``paged_attention.decode_config``).

Reads ``$OUT/kv_fp8_decode_kernel.json``; the float8 configuration for unsplit requests is the one
with the least ``ragged`` + ``mid`` time, the one for split requests the least ``tail`` time. Runs
``bench throughput --workload nano --kv-cache-dtype fp8`` in this process with those set, writing
``$OUT/nano-kv-fp8tuned-1.json`` and ``$OUT/trace-kv-fp8tuned-1.json`` (``run_kv_fp8.sh``'s tables
pick them up). Usage (GPU machine, repo root, after the kernel sweep):
``python benchmarks/gpu/kv_fp8_nano_tuned.py``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedllm.attention.triton_kernels import paged_attention  # noqa: E402
from pagedllm.entrypoints import cli  # noqa: E402


def best_configs(rows: list[dict]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(unsplit, split) float8 configurations of least time from the sweep's rows."""
    times: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r["variant"] == "fp8" and "ms" in r:
            times.setdefault((r["tile_n"], r["warps"], r["stages"]), {})[r["shape"]] = r["ms"]
    unsplit = min((c for c, t in times.items() if {"ragged", "mid"} <= t.keys()),
                  key=lambda c: times[c]["ragged"] + times[c]["mid"])
    split = min((c for c, t in times.items() if "tail" in t), key=lambda c: times[c]["tail"])
    return unsplit, split


def main() -> int:
    out = os.environ.get("OUT", "/tmp/kv-fp8")
    with open(os.path.join(out, "kv_fp8_decode_kernel.json")) as f:
        unsplit, split = best_configs(json.load(f)["rows"])
    print(f"fp8 decode configs: unsplit {unsplit} (default {paged_attention._FP8_DECODE_CONFIG}), "
          f"split {split} (default {paged_attention._FP8_DECODE_SPLIT_CONFIG})")
    paged_attention._FP8_DECODE_CONFIG, paged_attention._FP8_DECODE_SPLIT_CONFIG = unsplit, split
    return cli.main(["bench", "throughput", "--workload", "nano", "--model", "benchmarks/configs/qwen3-0.6b",
                     "--load-format", "dummy", "--skip-tokenizer-init", "--max-model-len", "4096",
                     "--temperature", "0.6", "--kv-cache-dtype", "fp8",
                     "--output-json", os.path.join(out, "nano-kv-fp8tuned-1.json"),
                     "--trace-steps", os.path.join(out, "trace-kv-fp8tuned-1.json")])


if __name__ == "__main__":
    raise SystemExit(main())
