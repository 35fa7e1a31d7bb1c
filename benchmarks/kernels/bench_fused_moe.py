"""Fused-MoE experts at decode sizes: the direct GEMVs against the sorted grouped GEMM, one script.

For the Qwen3-30B-A3B expert shape (128 experts, top 8, hidden 2048, expert size 768) and Mixtral's
(8 experts, top 2, 4096 x 14336), at 1-256 tokens of random routing: the time of routing + experts
(``select_experts`` then ``fused_experts_direct`` with each candidate ``(block_n, block_k,
num_warps)``, or ``fused_experts`` with the tuned grouped config), replayed from a CUDA graph, and
the floor: the distinct chosen experts' weight bytes over the measured copy bandwidth. The answer
sets ``DeviceTuning.moe_gemv_max_per_expert`` and ``moe_gemv_config`` (``pagedllm/layers/tuning.py``).

    python benchmarks/kernels/bench_fused_moe.py [--out $OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.int4_decode_bench import graph_time_us  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}
GEMV_CONFIGS = [(32, 256, 4), (16, 256, 4), (64, 128, 4), (32, 512, 8), (64, 256, 8)]


def copy_gb_per_s() -> float:
    import torch

    buf = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(buf)
    us = graph_time_us(lambda: dst.copy_(buf), calls=5)
    return 2 * buf.numel() / us / 1e3


def bench_shape(name: str, tokens_list: list[int], bandwidth: float) -> list[dict]:
    import torch

    from pagedllm.layers.fused_moe import select_experts
    from pagedllm.layers.kernels.fused_moe import fused_experts, fused_experts_direct
    from pagedllm.layers.tuning import HOPPER

    hidden, inter, experts, top_k = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    expert_bytes = 3 * inter * hidden * 2
    rows = []
    for tokens in tokens_list:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16, generator=gen)
        distinct = int(select_experts(logits, top_k, True)[1].unique().numel())
        floor_us = distinct * expert_bytes / bandwidth / 1e3
        grouped_config = HOPPER.moe_gemm_config(tokens * top_k, experts)

        def grouped(x=x, logits=logits, config=grouped_config):
            w, ids = select_experts(logits, top_k, True)
            return fused_experts(x, w13, w2, w, ids, 0, False, config)

        row = {"shape": name, "tokens": tokens, "distinct_experts": distinct, "floor_us": floor_us,
               "grouped_us": graph_time_us(grouped, calls=10), "direct_us": {}}
        want = grouped()
        for config in GEMV_CONFIGS if tokens * top_k <= 4 * experts else ():  # beyond: far slower
            def direct(x=x, logits=logits, config=config):
                w, ids = select_experts(logits, top_k, True)
                return fused_experts_direct(x, w13, w2, w, ids, 0, config)

            err = float((direct().float() - want.float()).abs().max() / want.float().abs().max())
            assert err < 2e-2, (name, tokens, config, err)
            row["direct_us"][str(config)] = graph_time_us(direct, calls=10)
        rows.append(row)
    return rows


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    ns = p.parse_args()
    bandwidth = copy_gb_per_s()
    result = {"device": torch.cuda.get_device_name(), "copy_gb_per_s": bandwidth, "rows": []}
    for name in SHAPES:
        result["rows"] += bench_shape(name, ns.tokens, bandwidth)
    print(f"{result['device']}: copy {bandwidth:.0f} GB/s; routing + experts, us (CUDA graph replays)")
    print(f"{'shape':<14} {'tok':>3} {'experts':>7} {'floor':>6} {'grouped':>8} " +
          " ".join(f"{c!s:>14}" for c in GEMV_CONFIGS))
    for r in result["rows"]:
        print(f"{r['shape']:<14} {r['tokens']:>3} {r['distinct_experts']:>7} {r['floor_us']:>6.1f} {r['grouped_us']:>8.1f} " +
              " ".join(f"{r['direct_us'].get(str(c), float('nan')):>14.1f}" for c in GEMV_CONFIGS))
    os.makedirs(ns.out, exist_ok=True)
    Path(ns.out, "fused-moe-decode.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
