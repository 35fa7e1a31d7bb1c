"""CPU: the model's linear layers through ``F.linear`` (MKL) vs oneDNN with prepacked weights.

Loads the embedded SmolLM2-135M (float32) through the engine, then times one pass over all of its
linear layers (30 decoder layers x 4 projections + the LM head) at several row counts, alternating
the two paths in the same process (best of ``--repeats``). This is what ``layers/cpu_gemm.py``
changes in a CPU decode step; on a shared machine compare the ratios, not the absolute times.

    python benchmarks/cpu_linear.py [--rows 1 8 32 64 128 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from pagedllm import LLM  # noqa: E402
from pagedllm.layers import Linear, LMHead  # noqa: E402


def time_pass(layers, rows: int, packed: bool, repeats: int) -> float:
    saved = [m.cpu_packed_weight for m in layers]
    if not packed:
        for m in layers:
            m.cpu_packed_weight = None
    inputs = {m.weight.shape[1]: torch.randn(rows, m.weight.shape[1]) for m in layers}
    try:
        best = float("inf")
        for _ in range(repeats + 1):  # the first pass warms up
            t0 = time.perf_counter()
            for m in layers:
                m(inputs[m.weight.shape[1]])
            best = min(best, time.perf_counter() - t0)
        return best * 1e3
    finally:
        for m, w in zip(layers, saved):
            m.cpu_packed_weight = w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 512])
    ap.add_argument("--repeats", type=int, default=3)
    ns = ap.parse_args()
    torch.set_grad_enabled(False)
    llm = LLM()
    model = llm.llm_engine.engine_core.runner.model
    layers = [m for m in model.modules() if isinstance(m, (Linear, LMHead))]
    assert all(m.cpu_packed_weight is not None for m in layers), "the CPU runner should have packed them"
    print(f"{len(layers)} linear layers, {sum(m.weight.numel() for m in layers) * 4 / 2**20:.0f} MiB fp32")
    print("| rows | F.linear ms | prepacked ms | speed-up |")
    print("|---|---|---|---|")
    for rows in ns.rows:
        plain = time_pass(layers, rows, False, ns.repeats)
        packed = time_pass(layers, rows, True, ns.repeats)
        print(f"| {rows} | {plain:.1f} | {packed:.1f} | {plain / packed:.2f}x |")


if __name__ == "__main__":
    main()
