"""Thin GEMMs (M = 16..256 rows) on the GPU by cuBLAS in the layouts and libraries torch offers:
``F.linear(x, W)`` with W stored [N, K] (cuBLAS, and cuBLASLt via
``torch.backends.cuda.preferred_blas_library``), and ``x @ Wt`` with the weight stored transposed
[K, N]. Projection shapes of Qwen3-0.6B and Llama-3.1-8B; 8 weight copies per CUDA graph so W comes
from HBM. Prints microseconds per call and TB/s of weight bytes.
Run on the device from the repo root: ``python benchmarks/kernels/bench_gemm_layouts.py --out $OUT/gemm_layouts.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.bench_skinny_gemm import SHAPES, time_us  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--tunable", action="store_true", help="also F.linear under TunableOp (torch.cuda.tunable)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name, (n, k) in SHAPES.items():
        if "lm_head" in name:
            continue
        copies = 8
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        wts = [w.t().contiguous() for w in ws]
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            res = {"shape": name, "N": n, "K": k, "M": m}
            torch.backends.cuda.preferred_blas_library("cublas")
            res["linear_cublas_us"] = time_us(lambda i, x=x, ws=ws: F.linear(x, ws[i]))
            res["nn_cublas_us"] = time_us(lambda i, x=x, wts=wts: torch.mm(x, wts[i]))
            torch.backends.cuda.preferred_blas_library("cublaslt")
            res["linear_cublaslt_us"] = time_us(lambda i, x=x, ws=ws: F.linear(x, ws[i]))
            res["nn_cublaslt_us"] = time_us(lambda i, x=x, wts=wts: torch.mm(x, wts[i]))
            torch.backends.cuda.preferred_blas_library("cublas")
            if args.tunable:
                torch.cuda.tunable.enable(True)
                torch.cuda.tunable.tuning_enable(True)
                res["linear_tunable_us"] = time_us(lambda i, x=x, ws=ws: F.linear(x, ws[i]))
                torch.cuda.tunable.enable(False)
            err = (torch.mm(x, wts[0]).float() - F.linear(x, ws[0]).float()).abs().max().item()
            res["max_abs_diff_nn_vs_linear"] = err
            nbytes = n * k * 2
            line = " ".join(
                f"{key[:-3]} {res[key]:7.2f}us {nbytes / res[key] / 1e6:4.2f}TB/s"
                for key in res
                if key.endswith("_us")
            )
            print(f"{name:12s} M={m:3d} {line}", flush=True)
            rows.append(res)
        ws = wts = None
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
