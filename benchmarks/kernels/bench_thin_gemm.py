"""Decode-batch linear layers (M = 16..256 rows) on the GPU: cuBLAS (F.linear) against the Triton
GEMM of pagedllm/layers/kernels/thin_gemm.py, on the projection shapes of Llama-3.1-8B (M=64, the
latency target's batch) and Qwen3-0.6B (M=64..256, the nano-bench's decode batches).

Each timing replays a CUDA graph of calls on enough weight copies (>= 256 MB in all) that W comes
from HBM, not L2; it reports microseconds per call and TB/s of weight bytes. For each shape and M a
small search: row tile x column tile (K in 128-element chunks; split-K chosen to fill the SMs, and
twice that), then the K chunk, stages and warps around the best, then ``pick_config``'s default for comparison.

Run on the device from the repo root: ``python benchmarks/kernels/bench_thin_gemm.py --out $OUT/thin.json``
(``--only 8b`` / ``--only 0.6b``; ``--m 64 128``).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from pagedllm.layers.kernels.thin_gemm import ThinGemmConfig, pick_config, thin_linear

SHAPES = {  # name: (N, K)
    "8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (28672, 4096), "8b down": (4096, 14336),
    "0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate_up": (6144, 1024), "0.6b down": (1024, 3072),
}
DEFAULT_M = {"8b": (64,), "0.6b": (64, 128, 256)}


def time_us(fn_per_copy, copies: int) -> float:
    """Microseconds per call of ``fn_per_copy(i)``, i = 0..copies-1, replayed in a CUDA graph."""

    def run():
        for i in range(copies):
            fn_per_copy(i)

    run()
    torch.cuda.synchronize()
    return 1e3 * do_bench_cudagraph(run, rep=20, return_mode="median") / copies


def splits_for(m: int, n: int, k: int, bm: int, bn: int, bk: int, sms: int) -> list[int]:
    tiles = math.ceil(n / bn) * math.ceil(m / bm)
    fits = [s for s in (1, 2, 4, 8) if k % (bk * s) == 0]
    first = next((s for s in fits if tiles * s >= sms), fits[-1])
    return sorted({first, *(s for s in fits if s == 2 * first)})


def bench(name: str, n: int, k: int, ms: tuple[int, ...], sms: int, dev: torch.device) -> list[dict]:
    nbytes = n * k * 2
    copies = max(2, min(64, math.ceil(256e6 / nbytes)))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x.float(), ws[0].float())
        res = {"shape": name, "N": n, "K": k, "M": m, "copies": copies}
        res["cublas_us"] = time_us(lambda i, x=x: F.linear(x, ws[i]), copies)
        tried: dict[ThinGemmConfig, float] = {}

        def trial(cfg: ThinGemmConfig, x=x, ref=ref, m=m, tried=tried) -> None:
            if cfg in tried:
                return
            try:
                err = float((thin_linear(x, ws[0], config=cfg).float() - ref).norm() / ref.norm())
                assert err < 1e-2, f"rel err {err}"
                tried[cfg] = time_us(lambda i: thin_linear(x, ws[i], config=cfg), copies)
            except Exception as e:  # noqa: BLE001 (out of resources, or wrong)
                print(name, m, cfg, "failed:", repr(e)[:160])
                tried[cfg] = float("inf")

        bm_options = sorted({min(max(16, 1 << (m - 1).bit_length()), 64), *((128,) if m >= 128 else ())})
        for bm in bm_options:
            for bn in (32, 64, 128):
                for s in splits_for(m, n, k, bm, bn, 128, sms):
                    trial(ThinGemmConfig(bm, bn, 128, s))
        best = min(tried, key=tried.get)
        for bk in (64, 256):
            if k % (bk * best.split_k) == 0:
                trial(ThinGemmConfig(best.block_m, best.block_n, bk, best.split_k))
        best = min(tried, key=tried.get)
        for stages in (3, 5, 6):
            trial(ThinGemmConfig(best.block_m, best.block_n, best.block_k, best.split_k, best.num_warps, stages))
        best = min(tried, key=tried.get)
        trial(ThinGemmConfig(best.block_m, best.block_n, best.block_k, best.split_k, 8, best.num_stages))
        best = min(tried, key=tried.get)
        default = pick_config(m, n, k, sms)
        trial(default)
        res.update(best_us=tried[best], best_cfg=best.__dict__, default_us=tried[default], default_cfg=default.__dict__,
                   cublas_tbps=nbytes / res["cublas_us"] / 1e6, best_tbps=nbytes / tried[best] / 1e6,
                   tried=[dict(cfg.__dict__, us=us) for cfg, us in sorted(tried.items(), key=lambda kv: kv[1])])
        rows.append(res)
        print(f"{name:13s} M={m:3d}: cublas {res['cublas_us']:7.2f} us ({res['cublas_tbps']:.2f} TB/s) | "
              f"triton best {tried[best]:7.2f} us ({res['best_tbps']:.2f} TB/s) {best} | default {tried[default]:7.2f}",
              flush=True)
    return rows


def dump(path: str, dev: torch.device, t0: float, rows: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"what": "decode-batch linear: cuBLAS vs the Triton thin GEMM", "device": torch.cuda.get_device_name(dev),
                   "date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/kernels/bench_thin_gemm.py",
                   "seconds": time.time() - t0, "rows": rows}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="shape-name prefix, e.g. 8b or 0.6b")
    ap.add_argument("--m", type=int, nargs="*", default=None)
    ns = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    t0 = time.time()
    rows = []
    for name, (n, k) in SHAPES.items():
        if ns.only and not name.startswith(ns.only):
            continue
        rows += bench(name, n, k, tuple(ns.m) if ns.m else DEFAULT_M[name.split()[0]], sms, dev)
        if ns.out:
            dump(ns.out, dev, t0, rows)
    print(f"{'shape':13s} {'M':>4s} {'cuBLAS us':>10s} {'best us':>8s} {'ratio':>6s}  best config")
    for r in rows:
        c = r["best_cfg"]
        print(f"{r['shape']:13s} {r['M']:4d} {r['cublas_us']:10.2f} {r['best_us']:8.2f} "
              f"{r['cublas_us'] / r['best_us']:6.2f}  m{c['block_m']} n{c['block_n']} k{c['block_k']} "
              f"s{c['split_k']} w{c['num_warps']} st{c['num_stages']}")


if __name__ == "__main__":
    main()
