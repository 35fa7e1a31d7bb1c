"""Time the fused sampler (``sample.triton_sampling.categorical_sample``) on the GPU.

Rows of Qwen3's vocabulary (151,936) in bf16, every row random (temperature 0.6) or every row
greedy, inside CUDA graphs. ``--baseline FILE`` also times the sampler of another copy of
the module (e.g. ``git show HEAD:pagedllm/sample/triton_sampling.py > /tmp/old.py``), in the same
run, so a change is measured as a ratio.

Usage (repo root, on the device): ``python benchmarks/kernels/bench_sampler.py [--baseline FILE]``
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def load(path: str):
    spec = importlib.util.spec_from_file_location(f"sampler_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 128, 256])
    ap.add_argument("--vocab", type=int, default=151_936)
    ns = ap.parse_args()
    import torch  # noqa: PLC0415

    from benchmarks.kernels.bench_attention import time_us  # noqa: PLC0415
    from pagedllm.sample import triton_sampling  # noqa: PLC0415

    impls = {"current": triton_sampling}
    if ns.baseline:
        impls["baseline"] = load(ns.baseline)
    print(f"{'rows':>5s} {'mode':>7s} " + " ".join(f"{k:>10s}" for k in impls) + "   (us; GB/s of logits read)")
    for rows in ns.rows:
        logits = torch.randn(rows, ns.vocab, device="cuda", dtype=torch.bfloat16)
        temp = torch.full((rows,), 0.6, device="cuda")
        seeds = torch.arange(rows, dtype=torch.int64, device="cuda") * 7919 + 3
        for mode in ("random", "greedy"):
            greedy = torch.full((rows,), mode == "greedy", dtype=torch.bool, device="cuda")
            cells = []
            for module in impls.values():
                def draw(m=module, logits=logits, temp=temp, greedy=greedy, seeds=seeds):
                    draw_fn = getattr(m, "categorical_sample", None) or m.gumbel_argmax  # older copies
                    return draw_fn(logits, temp, greedy, seeds)

                us = time_us(draw, graph=True)
                cells.append(f"{us:7.1f} {logits.numel() * 2 / us / 1e3:5.0f}")
            print(f"{rows:5d} {mode:>7s} " + " ".join(f"{c:>14s}" for c in cells))


if __name__ == "__main__":
    main()
