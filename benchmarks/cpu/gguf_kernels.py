"""The CPU GGUF kernels alone: int8-activation (``int8_activations=True``), float-activation, and
torch's float32 GEMM on the dequantized weights, for the embedded SmolLM2's shapes.

    python benchmarks/cpu/gguf_kernels.py [--threads 1] [--rows 1 8 64 256] [--output-json PATH]

Times are CPU seconds of this process (``time.process_time``) and wall seconds, best of
``--rounds`` rounds of the three kernels in turn: on a shared machine the CPU time of a
single-threaded run is the stable figure (wall time counts the time other jobs hold the core).
GB/s is the packed weight bytes over the kernel's time (batch 1: the memory-bound figure).
Random blocks with moderate scales; not part of CI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pagedllm.native import kernels as native  # noqa: E402

# (format, output rows N, input K): SmolLM2-135M's MLP up/down projections and a slice of its LM head.
SHAPES = [("Q4_1", 1536, 576), ("Q4_1", 576, 1536), ("Q8_0", 8192, 576)]


def random_packed(name: str, rows: int, k: int) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    elems, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    raw = np.random.default_rng(0).integers(0, 256, size=(rows, k // elems, nbytes), dtype=np.uint8)
    raw[..., 1] = 0x2C  # f16 scales near 0.06
    if name == "Q4_1":
        raw[..., 3] = 0x2C
    return raw.reshape(rows, -1)


def measure(fn, reps: int, rounds: int) -> tuple[float, float]:
    """(best CPU seconds, best wall seconds) per call."""
    fn()
    cpu = wall = float("inf")
    for _ in range(rounds):
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(reps):
            fn()
        cpu = min(cpu, (time.process_time() - c0) / reps)
        wall = min(wall, (time.perf_counter() - w0) / reps)
    return cpu, wall


def main() -> int:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--output-json", default=None)
    ns = p.parse_args()
    torch.set_num_threads(ns.threads)
    if native.load() is None:
        print("the CPU kernels could not be built")
        return 1
    isa = {0: "none", 1: "AVX2", 2: "VNNI"}[native.load().gguf_q8_isa()]
    print(f"{ns.threads} thread(s), int8 dot products: {isa}; times in ms of CPU (wall)")
    results = []
    for name, n, k in SHAPES:
        qtype = GGMLQuantizationType[name]
        raw = random_packed(name, n, k)
        packed, w = torch.from_numpy(raw), torch.from_numpy(dequantize(raw, qtype).reshape(n, k).copy())
        for m in ns.rows:
            x, out = torch.randn(m, k), torch.empty(m, n)
            kernels = {"int8": partial(native.gguf_matmul, x, packed, int(qtype), out, int8_activations=True),
                       "float": partial(native.gguf_matmul, x, packed, int(qtype), out),
                       "fp32_gemm": partial(torch.mm, x, w.t(), out=out)}
            reps = max(2, 200 // m)
            row = {"format": name, "n": n, "k": k, "m": m}
            for key, fn in kernels.items():
                row[f"{key}_cpu_ms"], row[f"{key}_wall_ms"] = (1e3 * t for t in measure(fn, reps, ns.rounds))
            row["int8_gb_per_s"] = raw.nbytes / row["int8_cpu_ms"] / 1e6
            results.append(row)
            print(f"{name} {n}x{k} M={m:<4} " + "  ".join(
                f"{key} {row[f'{key}_cpu_ms']:.3f} ({row[f'{key}_wall_ms']:.3f})" for key in kernels)
                + f" | fp32/int8 {row['fp32_gemm_cpu_ms'] / row['int8_cpu_ms']:.2f}x"
                f" float/int8 {row['float_cpu_ms'] / row['int8_cpu_ms']:.2f}x"
                f" int8 {row['int8_gb_per_s']:.1f} GB/s", flush=True)
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps({"threads": ns.threads, "isa": isa, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
