"""Int4 (GPTQ layout) decode against bf16: Llama-3.1-8B architecture, random weights, one script.

Two parts, each variant in its own process (a clean GPU for each engine):

1. kernels: the int4 dequantize-in-the-GEMM kernels (``quantization/kernels/int4_gemm.py``) against
   the bf16 GEMM the float layer runs (``F.linear``: cuBLAS), on the 8B projections (qkv, o,
   gate_up, down) at 1 to 256 rows (``--rows``): the word-row layout's dispatch (``n8``: what the
   engine runs; ``n8-act-order``: with the input gather), each of its kernels forced where it takes
   the rows (``gemv``, ``tiled``, ``dequant+cublas``), and the row-layout fallback at one row;
   each timed as 20 calls replayed from a CUDA graph, with the bytes each reads per second (int4:
   packed codes + fp16 scales and zeros; bf16: the weight). ``--sweep``: also the tiled GEMM's
   launch sizes at a few row counts (the tuning read off); ``--gguf``: the GGUF block kernels
   (``kernels/gguf_gemm.py``, Q4_0 .. Q6_K) on the o and gate_up shapes.
2. engine: the decode step (``bench latency``'s measure: (time for N tokens - time for 1) / (N - 1),
   best of 2) at batch 1 and 64 with 1024-token prompts, for bf16 weights, GPTQ int4 group 128,
   and GPTQ int4 group 128 with act-order; each against its floor (weight bytes as stored, without
   the embedding table, plus the KV cache at the mean context, over the measured copy bandwidth).
   The issue's target: int4 at batch 1 <= 0.4x the bf16 step.

Prints two tables and writes ``$OUT/int4-decode-8b.json`` (``--out`` to change). From the repo root:

    python benchmarks/gpu/int4_decode_bench.py            # about 5 minutes on an H100
    python benchmarks/gpu/int4_decode_bench.py --skip-engine   # the kernel table only (about 2 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The kernel table's device and input dtype (a CPU smoke test under TRITON_INTERPRET=1 sets others).
DEVICE, DTYPE = "cuda", "bfloat16"
CONFIG = ROOT / "benchmarks/configs/llama-3.1-8b/config.json"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256)
COLD_BYTES = 150e6  # bytes of weight copies the GEMV sweep cycles through (``cold_copies``)
SWEEP_ROWS = (16, 64)
COPY_BYTES_PER_S = 3.0e12  # an H100's measured copy bandwidth (the GEMV sweep's floor)  # row counts at which --sweep times the tiled GEMM's launch sizes
VARIANTS = {
    "bf16": None,
    "gptq-g128": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "gptq-g128-act-order": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True},
}


def graph_time_us(fn, calls: int = 20, copies: int | None = None) -> float:
    """Microseconds per call of ``fn``, replayed ``calls`` at a time from a CUDA graph (no launch gaps).
    ``copies``: ``fn(i)`` takes the weight copy ``i`` (call ``c`` uses copy ``c % copies``), so that
    the weights come from DRAM as in a decode step, not from L2 (``cold_copies``)."""
    import torch

    call = fn if copies is None else None
    calls = max(calls, copies or 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            (call or (lambda i=i: fn(i % copies)))()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            (call or (lambda i=i: fn(i % copies)))()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (5 * calls))
    return best


def cold_copies(nbytes: float) -> int:
    """Copies of a weight of ``nbytes`` that, taken in turn, overflow an H100's 50 MB L2 three times."""
    return max(1, -(-int(COLD_BYTES) // int(nbytes)))


def time_shape(name: str, n: int, k: int, rows: tuple[int, ...], sweep: bool) -> list[dict]:
    """The int4 kernels (``kernel_runs``) and bf16 ``F.linear`` for one ``[n, k]`` weight (GPTQ g128)
    at each row count; a kernel that fails is recorded with its error and the table goes on."""
    import torch
    import torch.nn.functional as F

    from pagedllm.quantization.int4 import N8_LAYOUT, ROWS_LAYOUT
    from pagedllm.quantization.kernels import int4_gemm

    words = {ROWS_LAYOUT: torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=DEVICE),
             N8_LAYOUT: torch.randint(-(2**31), 2**31 - 1, (n // 8, k), dtype=torch.int32, device=DEVICE)}
    scales = torch.full((n, k // 128), 0.01, dtype=torch.float16, device=DEVICE)
    zeros = torch.full((n, k // 128), 8.0, dtype=torch.float16, device=DEVICE)
    perm = torch.randperm(k, device=DEVICE).to(torch.int32)
    weight = torch.randn(n, k, dtype=getattr(torch, DTYPE), device=DEVICE)
    int4_bytes = n * k / 2 + 4 * n * (k // 128)
    sms = int4_gemm.num_sms(torch.cuda.current_device()) if DEVICE == "cuda" else 132
    out = []
    for m in rows:
        x = torch.randn(m, k, dtype=getattr(torch, DTYPE), device=DEVICE)
        bf16_us = graph_time_us(lambda x=x: F.linear(x, weight))
        # Each kernel's output against dequantize + cuBLAS (an independent path; the act-order
        # kernel against the same with the permuted input): relative max error, a correctness check.
        want = {kernel: int4_gemm.int4_dequant_matmul(x, words[layout], scales, zeros, p, 128, None,
                                                      layout=layout).float()
                for kernel, layout, p in (("n8", N8_LAYOUT, None), ("n8-act-order", N8_LAYOUT, perm),
                                          ("rows", ROWS_LAYOUT, None))}
        for kernel, fn, config in kernel_runs(x, words, scales, zeros, perm, sms, sweep):
            row = {"layer": name, "n": n, "k": k, "m": m, "kernel": kernel,
                   "config": list(config) if config != "default" else config, "bf16_us": bf16_us,
                   "bf16_gb_per_s": 2 * n * k / bf16_us / 1e3}
            try:
                ref = want.get(kernel, want["n8"])
                row["rel_err"] = float((fn().float() - ref).abs().max() / ref.abs().max())
                us = graph_time_us(fn)
                row.update(int4_us=us, ratio=us / bf16_us, int4_gb_per_s=int4_bytes / us / 1e3)
            except Exception as e:  # one launch size that does not compile or fit must not end the table
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            out.append(row)
    return out


def kernel_runs(x, words: dict, scales, zeros, perm, sms: int, sweep: bool) -> list[tuple]:
    """``(kernel, fn, config)`` to time at ``x``'s rows: the word-row dispatch (``n8``: what the
    engine runs; ``n8-act-order``: with the input gather), each word-row kernel forced where it takes
    the rows (``gemv``, ``tiled``, ``dequant+cublas``), the row-layout fallback at one row, and
    (``sweep``) the tiled GEMM's launch sizes at ``SWEEP_ROWS``."""
    from pagedllm.quantization.int4 import N8_LAYOUT, ROWS_LAYOUT
    from pagedllm.quantization.kernels import int4_gemm

    m, k = x.shape
    qw = words[N8_LAYOUT]
    n = qw.shape[0] * 8
    runs = [("n8", lambda: int4_gemm.int4_linear(x, qw, scales, zeros, None, 128, None, layout=N8_LAYOUT), "default"),
            ("n8-act-order", lambda: int4_gemm.int4_linear(x, qw, scales, zeros, perm, 128, None, layout=N8_LAYOUT),
             "default")]
    if m <= int4_gemm.GEMV_MAX_ROWS:
        runs.append(("gemv", lambda: int4_gemm.int4_gemv_n8(x, qw, scales, zeros, None, 128, None),
                     int4_gemm.gemv_n8_config(m, n, k, 128, sms)))
    runs.append(("tiled", lambda: int4_gemm.int4_gemm_n8(x, qw, scales, zeros, None, 128, None),
                 int4_gemm.tiled_n8_config(m, n, k, 128, sms)))
    if m >= 32:
        runs.append(("dequant+cublas", lambda: int4_gemm.int4_dequant_matmul(x, qw, scales, zeros, None, 128, None,
                                                                             layout=N8_LAYOUT), "default"))
    if m == 1:
        runs.append(("rows", lambda: int4_gemm.int4_linear(x, words[ROWS_LAYOUT], scales, zeros, None, 128, None),
                     "default"))
    if sweep and m in SWEEP_ROWS:
        runs += [("tiled sweep", lambda c=c: int4_gemm.int4_gemm_n8(x, qw, scales, zeros, None, 128, None, config=c),
                  c) for c in tiled_sweep(m, n, k, sms)]
    return runs


def tiled_sweep(m: int, n: int, k: int, sms: int) -> list[tuple[int, int, int, int, int]]:
    """Launch sizes of the tiled GEMM around its default (``tiled_n8_config``): output tiles of 64
    and 128, 4 and 8 warps, 3 and 4 pipeline stages, other K splits; those that do not divide the
    shape are left out."""
    from pagedllm.quantization.kernels import int4_gemm

    block_m, block_n, split, warps, stages = int4_gemm.tiled_n8_config(m, n, k, 128, sms)
    chunks = k // int4_gemm.tiled_n8_chunk(k, 128)[1]
    configs = [(block_m, b, max(1, split * block_n // b), w, s) for b in (64, 128) for w in (4, 8) for s in (3, 4)]
    configs += [(block_m, block_n, d, warps, stages) for d in (1, 2, 4, 8)]
    unique = dict.fromkeys(c for c in configs if n % c[1] == 0 and chunks % c[2] == 0 and c != (
        block_m, block_n, split, warps, stages))
    return list(unique)


def gemv_sweep_configs(default: tuple, k: int) -> list[tuple]:
    """Word-row GEMV launches (``int4_gemm.GemvN8Config``) around ``default`` for a weight of ``k``
    inputs at one row: the default, then with its eight sums reduced at once (``joint_sum``), with
    the zero points per code instead of per step, with the other warp count (4 or 2), with two word
    rows a program, with the step's loads hoisted."""
    warps, run, split, rows, fold, hoist, joint = default
    configs = [default, (warps, run, split, rows, fold, hoist, not joint), (warps, run, split, rows, not fold, hoist,
                                                                             joint),
               (6 - warps, run, split, rows, fold, hoist, joint), (warps, run, split, 2, fold, hoist, joint),
               (warps, run, split, rows, fold, not hoist, joint)]
    return [c for c in dict.fromkeys(configs) if k % (32 * c[0] * run * c[2]) == 0]


def time_gemv_sweep(name: str, n: int, k: int) -> list[dict]:
    """The one-row word-row GEMV of an ``[n, k]`` weight (GPTQ g128) at each ``gemv_sweep_configs``
    launch, the weights cold (``cold_copies`` of them in turn), against bf16 ``F.linear`` (cold too)
    and the bytes floor (packed codes + fp16 scales and zeros over ``COPY_BYTES_PER_S``)."""
    import torch
    import torch.nn.functional as F

    from pagedllm.quantization.kernels import int4_gemm

    dtype = getattr(torch, DTYPE)
    int4_bytes = n * k / 2 + 4 * n * (k // 128)
    copies = cold_copies(int4_bytes)
    words = [torch.randint(-(2**31), 2**31 - 1, (n // 8, k), dtype=torch.int32, device=DEVICE) for _ in range(copies)]
    scales = [torch.full((n, k // 128), 0.01, dtype=torch.float16, device=DEVICE) for _ in range(copies)]
    zeros = [torch.full((n, k // 128), 8.0, dtype=torch.float16, device=DEVICE) for _ in range(copies)]
    bf16 = [torch.randn(n, k, dtype=dtype, device=DEVICE) for _ in range(cold_copies(2 * n * k))]
    x = torch.randn(1, k, dtype=dtype, device=DEVICE)
    bf16_us = graph_time_us(lambda i: F.linear(x, bf16[i]), copies=len(bf16))
    floor_us = int4_bytes / COPY_BYTES_PER_S * 1e6
    default = tuple(int4_gemm.gemv_n8_config(1, n, k, 128, int4_gemm.num_sms(torch.cuda.current_device())
                                             if DEVICE == "cuda" else 132))
    rows = []
    for config in gemv_sweep_configs(default, k):
        row = {"layer": name, "n": n, "k": k, "config": list(config), "kind": "default" if config == default else "",
               "bf16_us": bf16_us, "floor_us": floor_us}
        try:
            us = graph_time_us(lambda i, c=config: int4_gemm.int4_gemv_n8(x, words[i], scales[i], zeros[i], None, 128,
                                                                          None, config=c), copies=copies)
            row.update(int4_us=us, ratio=us / bf16_us, over_floor=us / floor_us, int4_gb_per_s=int4_bytes / us / 1e3)
        except Exception as e:  # a launch that does not compile must not end the table
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print_gemv_sweep([row], header=not rows[:-1] and name == "qkv")  # as it goes: a timeout keeps the rows
    return rows


def time_gguf(name: str, n: int, k: int) -> list[dict]:
    """The GGUF block kernels (``kernels/gguf_gemm.py``) for one ``[n, k]`` weight at 1 and 64 rows,
    random blocks (timing does not depend on the values), against bf16 ``F.linear``."""
    import torch
    import torch.nn.functional as F

    from pagedllm.quantization.kernels import gguf_gemm

    weight = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
    rows = []
    for qtype, (_, qk, nbytes) in gguf_gemm.GGUF_BLOCKS.items():
        w = torch.randint(0, 256, (n, k // qk * nbytes), dtype=torch.uint8, device="cuda")
        for m in (1, 64):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            bf16_us = graph_time_us(lambda x=x: F.linear(x, weight))
            us = graph_time_us(lambda x=x, w=w, q=qtype: gguf_gemm.gguf_linear(x, w, q))
            rows.append({"layer": name, "qtype": qtype, "m": m, "us": us, "bf16_us": bf16_us, "ratio": us / bf16_us,
                         "gb_per_s": w.numel() / us / 1e3})
    return rows


def kernels_part(rows: tuple[int, ...], sweep: bool, gguf: bool, layers: list[str], gemv_sweep: bool) -> dict:
    return {"kernels": [row for name in layers for row in time_shape(name, *SHAPES[name], rows, sweep)],
            "gemv_sweep": [row for name in layers for row in time_gemv_sweep(name, *SHAPES[name])] if gemv_sweep else [],
            "gguf": [row for name in ("o", "gate_up") for row in time_gguf(name, *SHAPES[name])] if gguf else []}


def apply_int4_options(options: str) -> None:
    """Sets the int4 GEMV's options for this process before the engine is built: ``options`` is
    ``default`` or comma-separated ``word_rows=N`` / ``fold_zero=0|1`` / ``hoist=0|1`` /
    ``joint_sum=0|1`` (``int4_gemm.N8_WORD_ROWS`` / ``N8_FOLD_ZERO`` / ``N8_HOIST`` / ``N8_JOINT_SUM``:
    the one-row GEMV's defaults)."""
    from pagedllm.quantization.kernels import int4_gemm

    for item in options.split(",") if options != "default" else []:
        key, value = item.split("=")
        if key == "word_rows":
            int4_gemm.N8_WORD_ROWS = int(value)
        elif key == "fold_zero":
            int4_gemm.N8_FOLD_ZERO = bool(int(value))
        elif key == "hoist":
            int4_gemm.N8_HOIST = bool(int(value))
        elif key == "joint_sum":
            int4_gemm.N8_JOINT_SUM = bool(int(value))
        else:
            raise ValueError(f"--int4-options: unknown {item!r}")


def engine_part(variant: str, batch_sizes: list[int], input_len: int, output_len: int, profile: bool,
                int4_options: str = "default") -> dict:
    import random

    import torch

    if VARIANTS[variant] is not None:
        apply_int4_options(int4_options)
    from pagedllm import LLM
    from pagedllm.entrypoints.bench_latency import decode_step_seconds
    from pagedllm.entrypoints.bench_roofline import device_name, measure_copy_bandwidth

    folder = Path(tempfile.mkdtemp(prefix=f"int4-{variant}-"))
    config = json.loads(CONFIG.read_text())
    if VARIANTS[variant] is not None:
        config["quantization_config"] = VARIANTS[variant]
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096)
    runner = llm.llm_engine.engine_core.runner
    model = runner.model
    embed = model.model.embed_tokens.weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2
    bandwidth = measure_copy_bandwidth(runner.device)
    rng = random.Random(0)
    runs = []
    for bs in batch_sizes:
        def prompts(bs=bs):
            return [[rng.randrange(0, 100000) for _ in range(input_len)] for _ in range(bs)]

        step, _, _ = decode_step_seconds(llm, prompts, output_len, repeats=2)
        floor = (weight_bytes + bs * (input_len + output_len / 2) * kv_per_token) / bandwidth
        runs.append({"batch_size": bs, "decode_step_ms": step * 1e3, "floor_ms": floor * 1e3,
                     "step_over_floor": step / floor})
        print(f"{variant} batch {bs}: {step * 1e3:.3f} ms (floor {floor * 1e3:.3f} ms)", flush=True)
    result = {"variant": variant, "device": device_name(runner.device), "weight_bytes": weight_bytes,
              "copy_bytes_per_s": bandwidth, "torch": torch.__version__, "runs": runs}
    if profile:
        result["profile"] = {bs: profile_decode(llm, bs, input_len) for bs in batch_sizes}
    return result


def profile_decode(llm, batch: int, ctx: int, steps: int = 10) -> list[dict]:
    """The CUDA kernels of ``steps`` steady decode steps at ``batch`` requests of about ``ctx``
    tokens (torch.profiler): name, calls and microseconds per step, most time first (top 30), with
    the total; printed too."""
    import random

    import torch

    from pagedllm import SamplingParams

    engine = llm.llm_engine
    vocab = min(100000, engine.model_config.vocab_size)
    rng = random.Random(1)
    params = SamplingParams(max_tokens=steps + 20, ignore_eos=True, detokenize=False)
    for i in range(batch):
        engine.add_request(f"profile-{batch}-{i}", {"prompt_token_ids": [rng.randrange(0, vocab) for _ in range(ctx)]},
                           params)
    scheduler = engine.engine_core.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    rows = sorted(({"kernel": e.key[:90], "calls_per_step": e.count / steps,
                    "us_per_step": e.device_time_total / steps} for e in prof.key_averages() if e.device_time_total > 0),
                  key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    print(f"profile batch {batch}: {total:.0f} us of kernels a step")
    for r in rows[:30]:
        print(f"  {r['us_per_step']:8.1f} us {r['calls_per_step']:6.1f} calls  {r['kernel']}")
    return [{"kernel": "total", "calls_per_step": sum(r["calls_per_step"] for r in rows), "us_per_step": total},
            *rows[:30]]


def run_child(args: list[str], script: str = __file__) -> dict:
    """Runs ``script`` (this one by default) with ``args`` in a fresh process (its own GPU memory);
    returns the JSON it wrote to ``--child-json``, or ``{"error": ...}`` if it failed."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, script, *args, "--child-json", path], env=env, cwd=ROOT)
    if proc.returncode != 0:
        return {"error": f"{args} exited with {proc.returncode}"}
    return json.loads(Path(path).read_text())


def print_tables(result: dict) -> None:
    print("\nkernels (us per call, CUDA graph; int4 GPTQ g128 vs bf16 F.linear; GB/s: bytes read per second)")
    print(f"{'layer':8} {'m':>3} {'kernel':14} {'config':>15} {'int4 us':>8} {'int4 GB/s':>9} {'bf16 us':>8} "
          f"{'bf16 GB/s':>9} {'ratio':>6} {'rel err':>8}")
    for r in result.get("kernels", {}).get("kernels", []):
        config = "default" if r["config"] == "default" else ",".join(map(str, r["config"]))
        if "error" in r:
            print(f"{r['layer']:8} {r['m']:>3} {r['kernel']:14} {config:>15} error: {r['error']}")
            continue
        print(f"{r['layer']:8} {r['m']:>3} {r['kernel']:14} {config:>15} {r['int4_us']:>8.1f} "
              f"{r['int4_gb_per_s']:>9.0f} {r['bf16_us']:>8.1f} {r['bf16_gb_per_s']:>9.0f} {r['ratio']:>6.2f} "
              f"{r['rel_err']:>8.1e}")
    print_gemv_sweep(result.get("kernels", {}).get("gemv_sweep", []))
    gguf = result.get("kernels", {}).get("gguf", [])
    if gguf:
        print("\nGGUF block kernels (us per call, CUDA graph; random blocks) vs bf16 F.linear")
        print(f"{'layer':8} {'qtype':6} {'m':>3} {'us':>9} {'bf16 us':>9} {'ratio':>6} {'GB/s':>7}")
    for r in gguf:
        print(f"{r['layer']:8} {r['qtype']:6} {r['m']:>3} {r['us']:>9.1f} {r['bf16_us']:>9.1f} {r['ratio']:>6.2f} "
              f"{r['gb_per_s']:>7.0f}")
    print_engine_table(result["engine"], width=max([22, *map(len, result["engine"])]))


def print_gemv_sweep(rows: list[dict], header: bool = True) -> None:
    if not rows:
        return
    if header:
        print("\none-row word-row GEMV, weights cold (us per call; config: warps,run,split,word rows,fold zero,hoist,"
              "joint sum)")
        print(f"{'layer':8} {'config':>18} {'kind':7} {'int4 us':>8} {'floor us':>8} {'/floor':>6} {'GB/s':>6} "
              f"{'bf16 us':>8} {'ratio':>6}")
    for r in rows:
        config = ",".join(str(int(v)) for v in r["config"])
        if "error" in r:
            print(f"{r['layer']:8} {config:>18} {r['kind']:7} error: {r['error']}")
            continue
        print(f"{r['layer']:8} {config:>18} {r['kind']:7} {r['int4_us']:>8.1f} {r['floor_us']:>8.1f} "
              f"{r['over_floor']:>6.2f} {r['int4_gb_per_s']:>6.0f} {r['bf16_us']:>8.1f} {r['ratio']:>6.2f}", flush=True)


def print_engine_table(engine: dict, width: int) -> None:
    """The decode-step table of ``engine`` (variant -> its ``bench latency`` result), each step
    against its floor and against the ``bf16`` variant's step at the same batch size."""
    base = {r["batch_size"]: r["decode_step_ms"] for r in engine.get("bf16", {}).get("runs", [])}
    print("\ndecode step, Llama-3.1-8B architecture, random weights, 1024-token prompts")
    print(f"{'variant':{width}} {'batch':>5} {'step ms':>8} {'floor ms':>9} {'/floor':>7} {'vs bf16':>8}")
    for variant, res in engine.items():
        for r in res.get("runs", []):
            vs = r["decode_step_ms"] / base[r["batch_size"]] if r["batch_size"] in base else float("nan")
            print(f"{variant:{width}} {r['batch_size']:>5} {r['decode_step_ms']:>8.3f} {r['floor_ms']:>9.3f} "
                  f"{r['step_over_floor']:>7.2f} {vs:>8.2f}")
        if "error" in res:
            print(f"{variant:{width}} error: {res['error']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"), "int4-decode-8b.json"))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-engine", action="store_true", help="only the kernel timings (about a minute)")
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="row counts of the kernel table")
    p.add_argument("--layers", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="projections of the kernel table")
    p.add_argument("--sweep", action="store_true", help=f"also the tiled GEMM's launch sizes at {SWEEP_ROWS} rows")
    p.add_argument("--gguf", action="store_true", help="also the GGUF block kernels")
    p.add_argument("--gemv-sweep", action="store_true",
                   help="also the one-row GEMV's launch sizes, weights cold")
    p.add_argument("--profile", action="store_true", help="also the CUDA kernels of 10 decode steps per batch size")
    p.add_argument("--int4-options", nargs="+", default=["default"],
                   help="int4 engine runs, each 'default' or e.g. 'word_rows=2,fold_zero=0' "
                        "(apply_int4_options)")
    p.add_argument("--child", choices=["kernels", *VARIANTS], help=argparse.SUPPRESS)
    p.add_argument("--child-json", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.child:
        if ns.child == "kernels":
            out = kernels_part(tuple(ns.rows), ns.sweep, ns.gguf, ns.layers, ns.gemv_sweep)
        else:
            out = engine_part(ns.child, ns.batch_sizes, ns.input_len, ns.output_len, ns.profile, ns.int4_options[0])
        Path(ns.child_json).write_text(json.dumps(out))
        return 0
    sizes = ["--batch-sizes", *map(str, ns.batch_sizes), "--input-len", str(ns.input_len),
             "--output-len", str(ns.output_len)] + ["--profile"] * ns.profile
    kernel_args = (["--rows", *map(str, ns.rows), "--layers", *ns.layers] + ["--sweep"] * ns.sweep + ["--gguf"] * ns.gguf
                   + ["--gemv-sweep"] * ns.gemv_sweep)
    engine = {}
    for variant in [] if ns.skip_engine else ns.variants:
        for options in ns.int4_options if VARIANTS[variant] is not None else ["default"]:
            key = variant if options == "default" else f"{variant}[{options}]"
            engine[key] = run_child(["--child", variant, *sizes, "--int4-options", options])
    result = {"kernels": {} if ns.skip_kernels else run_child(["--child", "kernels", *kernel_args]), "engine": engine}
    print_tables(result)
    os.makedirs(os.path.dirname(ns.out) or ".", exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
