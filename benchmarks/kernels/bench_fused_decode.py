"""Decode at batch 1-2: the op before a GEMV folded into its prologue (layers/kernels/fused_gemv.py)
against the two launches it replaces, on Qwen3-0.6B and Llama-3.1-8B shapes, M = 1, 2.

- ``norm+qkv`` / ``norm+gate_up``: residual add + RMSNorm (``kernels/rms_norm.py``) then the linear
  (the Triton GEMV and cuBLAS), against ``rms_norm_linear``;
- ``silu+down``: SiLU-and-mul (``kernels/activation.py``) then the linear, against ``silu_and_mul_linear``.

Each timing replays a CUDA graph of ``--copies`` calls on as many weight copies (W read from HBM, not
L2; the small inputs stay in L2 as in a decode step) and reports microseconds per call. ``today`` is
what the model ran before the fusion (the norm / activation kernel, then the Triton GEMV where
``triton_ops.skinny_gemm_fits`` picks it, else cuBLAS); ``fused`` the fused kernel with its default
launch parameters, ``best`` the fastest of a small sweep (block_n, block_k, num_warps); ``taken``
whether the model takes the fused kernel there (``triton_ops.norm_prologue_fits`` /
``act_prologue_fits``). Run on the device from the repo root:
``python benchmarks/kernels/bench_fused_decode.py --out $OUT/fused_decode.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.bench_skinny_gemm import time_us  # noqa: E402

MODELS = {  # name: (hidden, q + 2 kv output width, intermediate)
    "0.6b": (1024, 2048 + 2 * 1024, 3072),
    "8b": (4096, 4096 + 2 * 1024, 14336),
}
ROWS = (1, 2)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--only", default="", help="only the models whose name starts with this (0.6b or 8b)")
    ap.add_argument("--copies", type=int, default=8, help="weight copies per graph (W read from HBM)")
    ap.add_argument("--no-sweep", action="store_true", help="time the default launch parameters only")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # tests: "cpu" under TRITON_INTERPRET
    return ap.parse_args(argv)


def sweep(fused_call, ref: torch.Tensor, n: int, k: int, copies: int, no_sweep: bool) -> tuple[float, dict, float]:
    """The fastest launch parameters near the defaults: ``(us, config, relative error vs ref)``;
    ``fused_call(i, **config)`` runs the fused kernel on weight copy i."""
    from pagedllm.layers.kernels.skinny_gemm import launch_config

    auto, _, _ = launch_config(ref.device, n, k)
    configs = [{}] if no_sweep else [
        dict(block_n=bn, block_k=bk, num_warps=w)
        for bn in sorted({auto, min(64, 2 * auto), min(64, 4 * auto)}) for bk in (512, 1024) for w in (4, 8)
    ]
    best = None
    for kw in configs:
        try:
            out = fused_call(0, **kw)
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            us = time_us(lambda i, kw=kw: fused_call(i, **kw), copies)
        except Exception as e:  # noqa: BLE001 (a config out of resources)
            print("  ", kw, "failed:", repr(e)[:120])
            continue
        if best is None or us < best[0]:
            best = (us, kw, err)
    return best


def bench_norm_linear(name: str, m: int, n: int, hidden: int, args) -> dict:
    """Residual add + RMSNorm then a ``[n, hidden]`` linear, at ``m`` rows."""
    import torch.nn.functional as F

    from pagedllm.layers import triton_ops
    from pagedllm.layers.kernels.fused_gemv import rms_norm_linear
    from pagedllm.layers.kernels.rms_norm import rms_norm
    from pagedllm.layers.kernels.skinny_gemm import skinny_linear
    from pagedllm.layers.tuning import for_device

    dev, dtype, eps = torch.device(args.device), torch.bfloat16, 1e-6
    g = (torch.randn(hidden, device=dev) * 0.1 + 1).to(dtype)
    x, res = (torch.randn(m, hidden, device=dev, dtype=dtype) for _ in range(2))
    ws = [torch.randn(n, hidden, device=dev, dtype=dtype) * 0.02 for _ in range(args.copies)]
    normed, _ = rms_norm(x, g, eps, res)

    def fused(i, **kw):
        return rms_norm_linear(x, res, g, eps, ws[i], **kw)[0]

    row = {
        "skinny_taken": triton_ops.skinny_gemm_fits(normed, ws[0], for_device(dev)),
        "taken": triton_ops.norm_prologue_fits(x, res, g, ws[0], for_device(dev)),
        "separate_gemv_us": time_us(lambda i: skinny_linear(rms_norm(x, g, eps, res)[0], ws[i]), args.copies),
        "separate_cublas_us": time_us(lambda i: F.linear(rms_norm(x, g, eps, res)[0], ws[i]), args.copies),
        "fused_us": time_us(fused, args.copies),
    }
    best = sweep(fused, F.linear(normed, ws[0]), n, hidden, args.copies, args.no_sweep)
    return report(name, m, n, hidden, row, best)


def bench_silu_and_mul_linear(name: str, m: int, n: int, inter: int, args) -> dict:
    """SiLU-and-mul of ``[m, 2 * inter]`` then an ``[n, inter]`` linear."""
    import torch.nn.functional as F

    from pagedllm.layers import triton_ops
    from pagedllm.layers.kernels.activation import silu_and_mul
    from pagedllm.layers.kernels.fused_gemv import silu_and_mul_linear
    from pagedllm.layers.kernels.skinny_gemm import skinny_linear
    from pagedllm.layers.tuning import for_device

    dev, dtype = torch.device(args.device), torch.bfloat16
    gate_up = torch.randn(m, 2 * inter, device=dev, dtype=dtype)
    ws = [torch.randn(n, inter, device=dev, dtype=dtype) * 0.02 for _ in range(args.copies)]
    act = silu_and_mul(gate_up)

    def fused(i, **kw):
        return silu_and_mul_linear(gate_up, ws[i], **kw)

    row = {
        "skinny_taken": triton_ops.skinny_gemm_fits(act, ws[0], for_device(dev)),
        "taken": triton_ops.act_prologue_fits(gate_up, ws[0], for_device(dev)),
        "separate_gemv_us": time_us(lambda i: skinny_linear(silu_and_mul(gate_up), ws[i]), args.copies),
        "separate_cublas_us": time_us(lambda i: F.linear(silu_and_mul(gate_up), ws[i]), args.copies),
        "fused_us": time_us(fused, args.copies),
    }
    best = sweep(fused, F.linear(act, ws[0]), n, inter, args.copies, args.no_sweep)
    return report(name, m, n, inter, row, best)


def report(name: str, m: int, n: int, k: int, row: dict, best) -> dict:
    """Complete the row (``today_us``: the two launches as the model ran them before) and print it."""
    today = row["separate_gemv_us"] if row["skinny_taken"] else row["separate_cublas_us"]
    row = {"op": name, "M": m, "N": n, "K": k, **row, "today_us": today,
           "best_us": best[0], "best_cfg": best[1], "rel_err": best[2]}
    print(f"{name:14s} M={m} N={n:6d} K={k:6d}: norm/act + GEMV {row['separate_gemv_us']:7.2f} us, + cuBLAS "
          f"{row['separate_cublas_us']:7.2f} us | fused {row['fused_us']:7.2f} us, best {best[0]:7.2f} us "
          f"{best[1]} err {best[2]:.1e} | today {today:7.2f} us, taken: {row['taken']}")
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    rows: list[dict] = []
    t_start = time.perf_counter()
    for model, (hidden, qkv_n, inter) in MODELS.items():
        if not model.startswith(args.only):
            continue
        for m in ROWS:
            rows.append(bench_norm_linear(f"{model} norm+qkv", m, qkv_n, hidden, args))
            rows.append(bench_norm_linear(f"{model} norm+gate_up", m, 2 * inter, hidden, args))
            rows.append(bench_silu_and_mul_linear(f"{model} silu+down", m, hidden, inter, args))
            torch.cuda.empty_cache()

    print("\n| op | M | today us | fused us (default) | fused best us | taken |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['M']} | {r['today_us']:.2f} | {r['fused_us']:.2f} | {r['best_us']:.2f} | {r['taken']} |")
    print("\n| model | M | today us/layer (3 pairs) | with the fusions where taken |")
    print("|---|---|---|---|")
    for model in MODELS:
        for m in ROWS:
            sel = [r for r in rows if r["op"].startswith(model + " ") and r["M"] == m]
            if sel:
                after = sum(r["fused_us"] if r["taken"] else r["today_us"] for r in sel)
                print(f"| {model} | {m} | {sum(r['today_us'] for r in sel):.2f} | {after:.2f} |")
    print(f"({time.perf_counter() - t_start:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(args.device), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
