"""FP8 weights at decode against bf16: Llama-3.1-8B architecture, random weights, one script.

Two parts, each in its own process (a clean GPU for each engine):

1. kernels: on the 8B projections (qkv, o, gate_up, down) at ``--rows`` rows (1 to 64), each timed
   as 20 calls replayed from a CUDA graph: bf16 ``F.linear`` (cuBLAS), per-token activation
   quantization + ``torch._scaled_mm`` (cuBLASLt), and the weight-only Triton GEMV
   (``quantization/kernels/fp8_gemv.py``) at its default launch sizes (at one row also with the
   other ``PREFETCH``), with the weight bytes read per second; at 33+ rows the batch-row GEMMs on
   codes (cuBLASLt, the Triton ``kernels/fp8_mm.py``, and that with the act-quant launch);
   ``--mm-sweep``: the Triton GEMM's launch sizes at 64 rows; ``--gemv1-sweep``: the one-row GEMV's
   launch sizes behind each projection's engine prologue (and the qkv + RoPE + K/V store kernel),
   on cold weights; the engines then run the fastest of them.
2. engine: the decode step (``bench latency``'s measure: (time for N tokens - time for 1) / (N - 1),
   best of 2) at batch 1 and 64 with 1024-token prompts, for ``VARIANTS`` (bf16, ``quantization=
   "fp8"``, fp8 weights with ``kv_cache_dtype="fp8"``, and those with the other batch-row GEMM or
   PREFETCH); each against its own floor (weight bytes as stored, without the embedding table, plus
   the KV cache at the mean context, over the measured copy bandwidth); ``--profile``: the CUDA
   kernels of 10 steps. The issue's targets: fp8 <= 0.6x the bf16 step, and within 1.2x of its floor.

Prints the tables and writes ``$OUT/fp8-decode-8b.json`` (``--out`` to change). From the repo root:

    python benchmarks/gpu/fp8_decode_bench.py --rows 1 64 --no-gemv-sweep --output-len 32   # ~3 min, H100
    python benchmarks/gpu/fp8_decode_bench.py --skip-engine --rows 64 --mm-sweep --gemv1-sweep
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.int4_decode_bench import (  # noqa: E402
    graph_time_us,
    print_engine_table,
    profile_decode,
    run_child,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "benchmarks/configs/llama-3.1-8b/config.json"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 2, 4, 8, 16, 32, 64)
# GEMV launch sizes (block_n, block_k, num_warps, dot) swept on SWEEP_SHAPES at SWEEP rows (the
# round-2 H100 figures chose gemv_config's defaults among them).
SWEEP_SHAPES = ("o", "gate_up")
# The batch-row Triton GEMM's launch sizes (block_m, block_n, block_k, num_warps, num_stages, tma) timed
# at 64 rows with ``--mm-sweep`` besides its default (round 1 chose the default among a wider sweep:
# split K and 128-row tiles lost everywhere; benchmarks/results/h100-80gb-hbm3-fp8-decode-*.json).
MM_SWEEP = [(64, 64, 128, 4, 6, False), (32, 64, 128, 4, 6, True), (64, 64, 128, 4, 8, True),
            (64, 64, 256, 4, 4, True), (32, 64, 256, 4, 4, True)]
# One-row GEMV launch sizes (block_n, block_k, num_warps, prefetch, chunk_sums) timed with
# ``--gemv1-sweep`` on cold weights, each projection behind the prologue the engine gives it.
# (Registers for sm_90, norm prologue: 128 / 174 / 72 / 96 / 96 / 99 in this order.)
GEMV1_SWEEP = [(8, 1024, 4, False, False), (8, 1024, 4, True, False), (8, 1024, 4, False, True),
               (16, 1024, 4, False, True), (32, 512, 4, False, True), (32, 1024, 8, False, True)]
SWEEP = {
    "fp8_mm(codes)": [(64, 256, 4, 3, None, False), (128, 128, 4, 4, None, False), (128, 128, 8, 4, None, False),
                      (64, 128, 4, 6, None, False), (64, 128, 4, 6, 1, False), (64, 128, 4, 4, None, True),
                      (128, 128, 4, 4, None, True), (64, 128, 4, 6, 1, True)],
    "w8a16_mm": [(128, 64, 8, 4, None, False), (128, 128, 8, 4, None, False), (128, 128, 8, 4, None, True)],
}
SWEEP = {
    1: [(4, 1024, 4, False), (16, 512, 4, False), (8, 2048, 8, False), (16, 1024, 8, False), (32, 256, 4, True)],
    4: [(16, 512, 4, False), (16, 512, 4, True), (64, 256, 4, True)],
    16: [(32, 256, 4, True), (128, 128, 4, True)],
    64: [(64, 128, 4, True), (128, 128, 4, True), (128, 256, 8, True)],
}
# Engine variants: LLM arguments, the batch-row GEMM of fp8 weights (``fp8_ops.BATCH_GEMM``) and the
# one-row GEMV's ``fp8_gemv.PREFETCH`` where set.
VARIANTS = {"bf16": {}, "fp8": {"quantization": "fp8"}, "fp8-kv-fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
            "fp8-scaled-mm": {"quantization": "fp8", "batch_gemm": "scaled_mm"},
            "fp8-kv-fp8-scaled-mm": {"quantization": "fp8", "kv_cache_dtype": "fp8", "batch_gemm": "scaled_mm"},
            "fp8-prefetch": {"quantization": "fp8", "prefetch": True},
            "fp8-kv-fp8-prefetch": {"quantization": "fp8", "kv_cache_dtype": "fp8", "prefetch": True}}
DEFAULT_VARIANTS = ["bf16", "fp8", "fp8-kv-fp8"]


def time_batch_gemms(name: str, n: int, k: int, m: int, wq, w_scale, bf16_us: float, sweep: bool) -> list[dict]:
    """At batch rows: cuBLASLt and the Triton FP8 GEMM (``kernels/fp8_mm.py``) on codes made
    beforehand (the GEMM alone), the Triton GEMM with the act-quant launch, and with ``sweep`` at 64
    rows the Triton GEMM at ``MM_SWEEP``'s launch sizes; the weight bytes read per second."""
    import torch

    from pagedllm.quantization import fp8_ops
    from pagedllm.quantization.kernels import fp8_mm

    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    xq, x_scale = fp8_ops.quantize_activations(x, None)
    ref = (xq.float() * x_scale) @ fp8_ops.dequantize_rows(wq, w_scale).t()
    runs = [
        ("scaled_mm(codes)", (), lambda: fp8_ops.fp8_linear_scaled_mm(xq, x_scale, wq, w_scale, torch.bfloat16)),
        ("fp8_mm(codes)", None, lambda: fp8_mm.fp8_mm(xq, x_scale, wq, w_scale)),
        ("quant+fp8_mm", None, lambda: fp8_mm.fp8_mm(*fp8_ops.quantize_activations(x, None), wq, w_scale)),
    ]
    runs += [("fp8_mm(codes)", c, lambda c=c: fp8_mm.fp8_mm(xq, x_scale, wq, w_scale, config=c))
             for c in (MM_SWEEP if sweep and m == 64 else [])]
    rows = []
    for kernel, config, fn in runs:
        used = fp8_mm.mm_config(m, n, k) if config is None else config
        row = {"layer": name, "m": m, "kernel": kernel, "config": list(used), "default": config is None}
        rows.append(_timed(row, fn, ref, n * k, bf16_us))
    return rows


def _timed(row: dict, fn, want, weight_bytes: int, bf16_us: float | None = None) -> dict:
    """``row`` with ``fn``'s time (CUDA graph), weight bytes per second and error against ``want``
    (None: not checked; 0 printed), or the error it raised; printed."""
    head = f"{row['layer']:8} {row['m']:>3} {row['kernel']:18} {','.join(map(str, row['config'])):>22}"
    try:
        y = fn().float()
        err = 0.0 if want is None else float((y - want).abs().max() / want.abs().max())
        us = graph_time_us(fn)
        row.update({"us": us, "gb_per_s": weight_bytes / us / 1e3, "rel_err": err})
        vs = f" {us / bf16_us:>5.2f}x bf16" if bf16_us else ""
        print(f"{head} {us:>7.1f} us {weight_bytes / us / 1e3:>6.0f} GB/s{vs} err {err:.1e}", flush=True)
    except Exception as e:  # a kernel that fails to build is recorded; the table goes on
        row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        print(f"{head} {row['error']}", flush=True)
    return row


def time_gemv1(name: str, n: int, k: int) -> list[dict]:
    """The one-row FP8 GEMV at ``GEMV1_SWEEP``'s launch sizes behind the prologue the engine gives the
    projection (qkv, gate_up: residual add + RMSNorm; down: SiLU-and-mul; o: none; and for qkv the
    one-launch norm + qkv + RoPE + K/V store kernel), each call on another copy of the weight (over
    120 MB in all: read from HBM, not L2, as in a decode step)."""
    import itertools

    import torch

    from pagedllm.quantization import fp8_ops
    from pagedllm.quantization.kernels import fp8_gemv, fp8_qkv_rope

    default_prefetch, default_chunk_sums = fp8_gemv.PREFETCH, fp8_gemv.CHUNK_SUMS
    copies = [fp8_ops.quantize_rows(torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02)
              for _ in range(max(2, -(-120_000_000 // (n * k))))]
    prologue = {"qkv": "norm", "gate_up": "norm", "down": "act", "o": None}[name]
    x = torch.randn(1, 2 * k if prologue == "act" else k, dtype=torch.bfloat16, device="cuda")
    residual, g = torch.randn(1, k, dtype=torch.bfloat16, device="cuda"), torch.rand(k, device="cuda").bfloat16()
    rows = []
    for block_n, block_k, warps, prefetch, chunk_sums in GEMV1_SWEEP:
        cycle = itertools.cycle(copies)
        config = (block_n, block_k, warps, False, fp8_gemv.split_k(n, k, block_n, block_k, fp8_gemv.num_sms(0)))

        def call(config=config, cycle=cycle):
            wq, w_scale = next(cycle)
            if prologue == "norm":
                return fp8_gemv.rms_norm_fp8_gemv(x, residual, g, 1e-5, wq, w_scale, None, config)[0]
            if prologue == "act":
                return fp8_gemv.silu_and_mul_fp8_gemv(x, wq, w_scale, None, config)
            return fp8_gemv.fp8_gemv(x, wq, w_scale, None, config)

        fp8_gemv.PREFETCH, fp8_gemv.CHUNK_SUMS = prefetch, chunk_sums
        kernel = f"gemv1-{prologue or 'plain'}" + ("-pf" if prefetch else "") + ("-cs" if chunk_sums else "")
        row = {"layer": name, "m": 1, "kernel": kernel, "config": [block_n, block_k, warps, config[-1]]}
        rows.append(_timed(row, call, None, n * k))  # correctness: tests/quantization/test_fp8_gemv.py
    fp8_gemv.PREFETCH, fp8_gemv.CHUNK_SUMS = default_prefetch, default_chunk_sums
    if name == "qkv":
        heads = n // 128 - 16  # 32 q + 8 k + 8 v heads of 128
        cache = torch.zeros(2, 64, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
        cos = torch.rand(4096, 64, device="cuda")
        pos, slot = torch.tensor([100], device="cuda"), torch.tensor([7], device="cuda")
        for prefetch in (False, True):
            fp8_gemv.PREFETCH = prefetch
            cycle = itertools.cycle(copies)

            def fn(cycle=cycle):
                return fp8_qkv_rope.fp8_qkv_rope(x, residual, g, 1e-5, *next(cycle), None, pos, cos, cos, heads, 8,
                                                 cache, slot)[0]

            row = {"layer": name, "m": 1, "kernel": "qkv-rope" + ("-pf" if prefetch else ""),
                   "config": [fp8_qkv_rope.BLOCK_P, fp8_qkv_rope.BLOCK_K, fp8_qkv_rope.NUM_WARPS]}
            rows.append(_timed(row, fn, None, n * k))
        fp8_gemv.PREFETCH = default_prefetch
    return rows


def fp8_gemv_split(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    from pagedllm.quantization.kernels import fp8_gemv

    return fp8_gemv.split_k(n, k, block_n, block_k, sms)


def time_shape(name: str, n: int, k: int, rows_to_time: tuple[int, ...] = ROWS, gemv_sweep: bool = True,
               mm_sweep: bool = False) -> list[dict]:
    """bf16 ``F.linear``, the FP8 cuBLASLt path and the FP8 GEMV (default and, on ``SWEEP_SHAPES``,
    swept launch sizes) for one ``[n, k]`` weight."""
    import torch
    import torch.nn.functional as F

    from pagedllm.quantization import fp8_ops
    from pagedllm.quantization.kernels import fp8_gemv

    weight = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
    wq, w_scale = fp8_ops.quantize_rows(weight)
    sms = fp8_gemv.num_sms(torch.cuda.current_device())
    rows = []
    for m in rows_to_time:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        ref = (x.float() @ fp8_ops.dequantize_rows(wq, w_scale).t())

        def scaled_mm(x=x):
            xq, x_scale = fp8_ops.quantize_activations(x, None)
            return fp8_ops.fp8_linear_scaled_mm(xq, x_scale, wq, w_scale, torch.bfloat16)

        base = {"layer": name, "n": n, "k": k, "m": m, "bf16_us": graph_time_us(lambda x=x: F.linear(x, weight)),
                "scaled_mm_us": graph_time_us(scaled_mm)}
        configs = [None] + ([(*c, fp8_gemv.split_k(n, k, c[0], c[1], sms)) for c in SWEEP.get(m, [])]
                            if name in SWEEP_SHAPES and gemv_sweep else [])
        # At one row also the GEMV with the other PREFETCH (its default launch sizes, "-" in the table).
        default_prefetch = fp8_gemv.PREFETCH
        others = [(None, not default_prefetch)] if m == 1 else []
        for config, prefetch in [(c, default_prefetch) for c in configs] + others:
            fp8_gemv.PREFETCH = prefetch
            used = config or fp8_gemv.gemv_config(m, n, k, sms)
            row = {**base, "config": list(used), "default": config is None and prefetch == default_prefetch,
                   "prefetch": prefetch}
            try:
                y = fp8_gemv.fp8_gemv(x, wq, w_scale, None, config)
                err = float((y.float() - ref).abs().max() / ref.abs().max())
                us = graph_time_us(lambda x=x, c=config: fp8_gemv.fp8_gemv(x, wq, w_scale, None, c))
                row.update({"gemv_us": us, "rel_err": err, "gemv_gb_per_s": n * k / us / 1e3,
                            "vs_bf16": us / base["bf16_us"], "vs_scaled_mm": us / base["scaled_mm_us"]})
            except Exception as e:  # a launch size the device cannot take: recorded, the sweep goes on
                row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            print_kernel_row(row)
            rows.append(row)
        fp8_gemv.PREFETCH = default_prefetch
        if m > fp8_gemv.GEMV_MAX_ROWS // 2:
            rows.extend(time_batch_gemms(name, n, k, m, wq, w_scale, base["bf16_us"], mm_sweep))
    return rows


def kernels_part(rows: tuple[int, ...] = ROWS, gemv_sweep: bool = True, mm_sweep: bool = False,
                 gemv1_sweep: bool = False) -> dict:
    import torch

    from pagedllm.entrypoints.bench_roofline import measure_copy_bandwidth

    copy = measure_copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s", flush=True)
    print_kernel_header()
    kernels = [row for name, (n, k) in SHAPES.items() for row in time_shape(name, n, k, rows, gemv_sweep, mm_sweep)]
    if gemv1_sweep:
        print("\none-row GEMV on cold weights behind its engine prologue (config: block_n,block_k,warps,split)")
        kernels += [row for name, (n, k) in SHAPES.items() for row in time_gemv1(name, n, k)]
    return {"copy_bytes_per_s": copy, "kernels": kernels}


def fastest_gemv1(kernels: dict) -> tuple[dict, bool, bool]:
    """From a ``--gemv1-sweep`` table: ``{(n, k): gemv_config}`` of the fastest one-row GEMV per
    projection, and the PREFETCH and CHUNK_SUMS of gate_up's fastest (the most bytes; one switch for
    all: the projections whose fastest differs take their fastest config under gate_up's switches)."""
    best: dict = {}
    gate_up = [r for r in kernels.get("kernels", []) if r.get("kernel", "").startswith("gemv1-") and "us" in r
               and r["layer"] == "gate_up"]
    switches = min(gate_up, key=lambda r: r["us"]) if gate_up else None
    prefetch, chunk_sums = ("-pf" in switches["kernel"], "-cs" in switches["kernel"]) if switches else (False, False)
    for r in kernels.get("kernels", []):
        if (r.get("kernel", "").startswith("gemv1-") and "us" in r
                and ("-pf" in r["kernel"], "-cs" in r["kernel"]) == (prefetch, chunk_sums)):
            n, k = SHAPES[r["layer"]]
            if (n, k) not in best or r["us"] < best[(n, k)]["us"]:
                best[(n, k)] = r
    return {shape: (*r["config"][:3], False, r["config"][3]) for shape, r in best.items()}, prefetch, chunk_sums


def engine_part(variant: str, batch_sizes: list[int], input_len: int, output_len: int, profile: bool,
                gemv1_from: str | None = None) -> dict:
    import random

    import torch

    from pagedllm import LLM
    from pagedllm.entrypoints.bench_latency import decode_step_seconds
    from pagedllm.entrypoints.bench_roofline import device_name, measure_copy_bandwidth
    from pagedllm.quantization import fp8_ops

    config = json.loads(CONFIG.read_text())
    from pagedllm.quantization.kernels import fp8_gemv

    args = dict(VARIANTS[variant])
    fp8_ops.BATCH_GEMM = args.pop("batch_gemm", fp8_ops.BATCH_GEMM)
    fp8_gemv.PREFETCH = args.pop("prefetch", fp8_gemv.PREFETCH)
    tuned = {}
    if gemv1_from and "quantization" in args:
        tuned, fp8_gemv.PREFETCH, fp8_gemv.CHUNK_SUMS = fastest_gemv1(json.loads(Path(gemv1_from).read_text()))
        default_config = fp8_gemv.gemv_config
        fp8_gemv.gemv_config = lambda m, n, k, sms: tuned[(n, k)] if m == 1 and (n, k) in tuned else default_config(
            m, n, k, sms)
        print(f"{variant}: one-row GEMV configs {tuned}, PREFETCH {fp8_gemv.PREFETCH}, "
              f"CHUNK_SUMS {fp8_gemv.CHUNK_SUMS}", flush=True)
    llm = LLM(str(CONFIG.parent), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, **args)
    runner = llm.llm_engine.engine_core.runner
    model = runner.model
    embed = model.model.embed_tokens.weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    kv_bytes = runner.kv_caches[0].element_size()
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * kv_bytes
    bandwidth = measure_copy_bandwidth(runner.device)
    rng = random.Random(0)
    runs = []
    for bs in batch_sizes:
        def prompts(bs=bs):
            return [[rng.randrange(0, config["vocab_size"]) for _ in range(input_len)] for _ in range(bs)]

        step, _, _ = decode_step_seconds(llm, prompts, output_len, repeats=2)
        floor = (weight_bytes + bs * (input_len + output_len / 2) * kv_per_token) / bandwidth
        runs.append({"batch_size": bs, "decode_step_ms": step * 1e3, "floor_ms": floor * 1e3,
                     "step_over_floor": step / floor})
        print(f"{variant} batch {bs}: {step * 1e3:.3f} ms (floor {floor * 1e3:.3f} ms)", flush=True)
    result = {"variant": variant, "device": device_name(runner.device), "weight_bytes": weight_bytes,
              "kv_bytes_per_element": kv_bytes, "batch_gemm": fp8_ops.BATCH_GEMM, "prefetch": fp8_gemv.PREFETCH,
              "chunk_sums": fp8_gemv.CHUNK_SUMS, "gemv1_configs": {f"{n}x{k}": c for (n, k), c in tuned.items()},
              "copy_bytes_per_s": bandwidth,
              "torch": torch.__version__, "runs": runs}
    if profile:
        result["profile"] = {bs: profile_decode(llm, bs, input_len) for bs in batch_sizes}
    return result


def print_kernel_header() -> None:
    print("\nkernels (us per call, CUDA graph): bf16 F.linear, fp8 act-quant + _scaled_mm, fp8 Triton GEMV "
          "(config: block_n,block_k,warps,dot,split; * default)")
    print(f"{'layer':8} {'m':>3} {'config':>22} {'bf16':>7} {'scaled':>7} {'gemv':>7} {'GB/s':>6} "
          f"{'/bf16':>6} {'/scaled':>7} {'err':>8}", flush=True)


def print_kernel_row(r: dict) -> None:
    config = ("* " if r["default"] else "- " if "prefetch" in r else "") + ",".join(
        str(int(v)) for v in r["config"])
    head = f"{r['layer']:8} {r['m']:>3} {config:>22} {r['bf16_us']:>7.1f} {r['scaled_mm_us']:>7.1f} "
    if "error" in r:
        print(head + r["error"], flush=True)
        return
    print(head + f"{r['gemv_us']:>7.1f} {r['gemv_gb_per_s']:>6.0f} {r['vs_bf16']:>6.2f} {r['vs_scaled_mm']:>7.2f} "
          f"{r['rel_err']:>8.1e}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"), "fp8-decode-8b.json"))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="row counts of the kernel table")
    p.add_argument("--profile", action="store_true", help="also the CUDA kernels of 10 decode steps per batch size")
    p.add_argument("--no-gemv-sweep", action="store_true", help="the GEMV at its default launch sizes only")
    p.add_argument("--mm-sweep", action="store_true", help="also the batch-row GEMM's launch sizes at 64 rows")
    p.add_argument("--gemv1-sweep", action="store_true",
                   help="also the one-row GEMV's launch sizes on cold weights; the engines then run the fastest")
    p.add_argument("--gemv1-from", help=argparse.SUPPRESS)
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-engine", action="store_true", help="only the kernel tables")
    p.add_argument("--child", choices=["kernels", *VARIANTS], help=argparse.SUPPRESS)
    p.add_argument("--child-json", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.child:
        out = (kernels_part(tuple(ns.rows), not ns.no_gemv_sweep, ns.mm_sweep, ns.gemv1_sweep) if ns.child == "kernels"
               else engine_part(ns.child, ns.batch_sizes, ns.input_len, ns.output_len, ns.profile, ns.gemv1_from))
        Path(ns.child_json).write_text(json.dumps(out))
        return 0
    sizes = ["--batch-sizes", *map(str, ns.batch_sizes), "--input-len", str(ns.input_len),
             "--output-len", str(ns.output_len)] + ["--profile"] * ns.profile
    result = {"kernels": {} if ns.skip_kernels else run_child(
        ["--child", "kernels", "--rows", *map(str, ns.rows)] + ["--no-gemv-sweep"] * ns.no_gemv_sweep
        + ["--mm-sweep"] * ns.mm_sweep + ["--gemv1-sweep"] * ns.gemv1_sweep, __file__)}
    if ns.gemv1_sweep and result["kernels"].get("kernels"):  # the engines take the sweep's fastest
        sizes += ["--gemv1-from", str(Path(ns.out).with_suffix(".kernels.json"))]
        Path(sizes[-1]).parent.mkdir(parents=True, exist_ok=True)
        Path(sizes[-1]).write_text(json.dumps(result["kernels"]))
    result["engine"] = {} if ns.skip_engine else {v: run_child(["--child", v, *sizes], __file__) for v in ns.variants}
    print_engine_table(result["engine"], width=12)
    os.makedirs(os.path.dirname(ns.out) or ".", exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
