"""Launch-parameter grid for the batch-1 GEMVs that a decode step runs (GPU only): the plain
weight-streaming GEMV (``skinny_gemm.skinny_linear``, the o projection), the RMSNorm-prologue one
(``fused_gemv.rms_norm_linear``, qkv and gate_up) and the SiLU-and-mul one
(``fused_gemv.silu_and_mul_linear``, down), at M=1 on the Llama-3.1-8B and Qwen3-0.6B shapes.
Each timing replays a CUDA graph over 8 weight copies (HBM reads), as ``bench_skinny_gemm.py``
does; prints the default and the five fastest configurations per shape.
Run on the device from the repo root: ``python benchmarks/kernels/bench_gemv_grid.py --out g.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.bench_skinny_gemm import time_us  # noqa: E402
from pagedllm.layers.kernels.fused_gemv import rms_norm_linear, silu_and_mul_linear  # noqa: E402
from pagedllm.layers.kernels.skinny_gemm import skinny_linear  # noqa: E402

SHAPES = {"8b qkv (norm)": (6144, 4096, "norm"), "8b o": (4096, 4096, "plain"),
          "8b gate_up (norm)": (28672, 4096, "norm"), "8b down (silu)": (4096, 14336, "silu"),
          "0.6b qkv (norm)": (4096, 1024, "norm"), "0.6b o": (1024, 2048, "plain"),
          "0.6b gate_up (norm)": (6144, 1024, "norm"), "0.6b down (silu)": (1024, 3072, "silu")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--block-n", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--block-k", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ns = ap.parse_args()
    dev = torch.device("cuda")
    results = []
    for name in ns.shapes:
        n, k, kind = SHAPES[name]
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(8)]
        x = torch.randn(1, 2 * k if kind == "silu" else k, device=dev, dtype=torch.bfloat16)
        res = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        g = torch.rand(k, device=dev, dtype=torch.bfloat16)

        def call(i, kind=kind, x=x, res=res, g=g, ws=ws, **kw):
            if kind == "norm":
                return rms_norm_linear(x, res, g, 1e-6, ws[i], **kw)[0]
            if kind == "silu":
                return silu_and_mul_linear(x, ws[i], **kw)
            return skinny_linear(x, ws[i], **kw)

        rows = [{"cfg": "default", "us": time_us(call)}]
        for bn, bk, warps, stages in itertools.product(ns.block_n, ns.block_k, ns.warps, (3,)):
            kw = dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
            try:
                rows.append({"cfg": kw, "us": time_us(lambda i, kw=kw: call(i, **kw))})
            except Exception as e:  # noqa: BLE001 (out of resources)
                print(name, kw, "failed", repr(e)[:80])
        best = sorted(rows[1:], key=lambda r: r["us"])[:5]
        gbps = n * k * 2 / 1e3
        print(f"{name}: default {rows[0]['us']:.2f} us ({gbps / rows[0]['us']:.0f} GB/s); best "
              + "; ".join(f"{r['us']:.2f} ({gbps / r['us']:.0f} GB/s) {r['cfg']}" for r in best), flush=True)
        results.append({"shape": name, "N": n, "K": k, "rows": rows})
        del ws
    if ns.out:
        Path(ns.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "shapes": results}, indent=1))


if __name__ == "__main__":
    main()
