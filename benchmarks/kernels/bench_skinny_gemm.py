"""Small-M linear layers on the GPU: cuBLAS (F.linear, and torch.mv at M=1) against the Triton
weight-streaming GEMV of pagedllm/layers/kernels/skinny_gemm.py, on the projection shapes of
Qwen3-0.6B and Llama-3.1-8B, at M = 1, 2, 4.

Each timing replays a CUDA graph of 8 calls on 8 different weight copies (so W is read from HBM,
not L2) and reports microseconds per call and GB/s of weight bytes. Run on the device from the repo
root: ``python benchmarks/kernels/bench_skinny_gemm.py --out $OUT/skinny.json``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from pagedllm.layers.kernels.skinny_gemm import pick_block_n, skinny_linear

SHAPES = {  # name: (N, K)
    "0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate_up": (6144, 1024), "0.6b down": (1024, 3072),
    "0.6b lm_head": (151936, 1024),
    "8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (28672, 4096), "8b down": (4096, 14336),
    "8b lm_head": (128256, 4096),
}
COPIES = 8


def time_us(fn_per_copy, copies: int = COPIES) -> float:
    """Microseconds per call of ``fn_per_copy(i)``, i = 0..copies-1, replayed in a CUDA graph."""

    def run():
        for i in range(copies):
            fn_per_copy(i)

    run()
    torch.cuda.synchronize()
    return 1e3 * do_bench_cudagraph(run, rep=50, return_mode="median") / copies


def bench_shape(name: str, n: int, k: int, sms: int, dev: torch.device) -> list[dict]:
    copies = 2 if "lm_head" in name else COPIES
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    nbytes = n * k * 2
    rows = []
    for m in (1, 2, 4):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x.float(), ws[0].float())
        res = {"shape": name, "N": n, "K": k, "M": m}
        res["cublas_us"] = time_us(lambda i, x=x: F.linear(x, ws[i % copies]))
        if m == 1:
            res["cublas_mv_us"] = time_us(lambda i, x=x: torch.mv(ws[i % copies], x[0]))
        res["triton_default_us"] = time_us(lambda i, x=x: skinny_linear(x, ws[i % copies]))
        auto = pick_block_n(n, sms)
        best = None
        for block_n in sorted({max(4, auto // 2), auto, min(64, auto * 2)}):
            for block_k in (512, 1024):
                for warps in (4, 8):
                    kw = dict(block_n=block_n, block_k=block_k, num_warps=warps)
                    try:
                        out = skinny_linear(x, ws[0], **kw)
                        err = float((out.float() - ref).norm() / ref.norm())
                        us = time_us(lambda i, kw=kw, x=x: skinny_linear(x, ws[i % copies], **kw))
                    except Exception as e:  # noqa: BLE001 (a config out of resources)
                        print(name, m, kw, "failed:", repr(e)[:120])
                        continue
                    if best is None or us < best[0]:
                        best = (us, kw, err)
        res["triton_best_us"], res["triton_best_cfg"], res["triton_rel_err"] = best
        res["cublas_gbps"] = nbytes / res["cublas_us"] / 1e3
        res["triton_best_gbps"] = nbytes / best[0] / 1e3
        rows.append(res)
        print(f"{name:14s} M={m}: cublas {res['cublas_us']:7.2f} us ({res['cublas_gbps']:5.0f} GB/s)"
              + (f" mv {res['cublas_mv_us']:7.2f}" if m == 1 else "")
              + f" | triton default {res.get('triton_default_us', float('nan')):7.2f}"
              f" best {best[0]:7.2f} us ({res['triton_best_gbps']:5.0f} GB/s) {best[1]} err {best[2]:.1e}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="", help="run only the shapes whose name starts with this (e.g. 8b)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows, t_start = [], time.perf_counter()
    for name, (n, k) in SHAPES.items():
        if not name.startswith(args.only):
            continue
        rows += bench_shape(name, n, k, sms, dev)
        torch.cuda.empty_cache()
    print("\n| model | M | cuBLAS us/layer | Triton best us/layer |")
    for model in ("0.6b", "8b"):
        for m in (1, 2, 4):
            sel = [r for r in rows if r["shape"].startswith(model) and "lm_head" not in r["shape"] and r["M"] == m]
            print(f"| {model} | {m} | {sum(r['cublas_us'] for r in sel):.1f} | {sum(r['triton_best_us'] for r in sel):.1f} |")
    print(f"({time.perf_counter() - t_start:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
