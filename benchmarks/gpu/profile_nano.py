"""Where the nano-bench's GPU time goes: the whole run under the CUDA profiler, every kernel
grouped by kind and by the step's batch band. Run from the repo root on the device:
``python benchmarks/gpu/profile_nano.py [OUT_JSON]``.

Steps are cut after the sampler kernels (the last kernels of every step); a step's band is the padded
batch of its split-KV decode launch (grid ``(kv_heads, batch, splits)``), or ``mixed`` when the
unified (prefill) kernel ran. Kernel durations come from CUPTI, so they are close to unprofiled
ones, but the wall time under the profiler is not the benchmark's.
"""

import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from pagedllm import LLM  # noqa: E402
from pagedllm.entrypoints.bench_roofline import ModelShape, generation_floor  # noqa: E402
from pagedllm.entrypoints.bench_throughput import Workload, make_workload, run_pagedllm  # noqa: E402

KINDS = [  # (kind, substrings of the kernel name), first match wins
    ("attn decode", ("_decode_split_kernel",)),
    ("attn reduce", ("_decode_reduce_kernel",)),
    ("attn prefill", ("_unified_attention_kernel",)),
    ("sampler", ("sampl", "gumbel", "argmax", "softmax")),  # "sampl": _sample_chunk_stats_kernel, _sample_draw_kernel
    ("gemv (triton)", ("gemv", "skinny")),
    ("gemm (cublas)", ("nvjet", "gemm", "xmma", "cutlass", "splitk", "splitK")),
    ("norm", ("norm",)),
    ("rope / kv store", ("rotary", "rope", "kv_store", "store_kv")),
    ("silu", ("silu", "act_and_mul", "swiglu")),
    ("embedding", ("embedding", "index_select", "indexSelect")),
    ("copy / fill", ("copy", "fill", "Memcpy", "Memset", "elementwise")),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k.lower() in low for k in keys):
            return kind
    return "other"


def band_of(bs: int | None) -> str:
    if bs is None:
        return "mixed"
    for hi in (1, 8, 32, 64, 128, 192, 256):
        if bs <= hi:
            return f"decode <= {hi}"
    return "decode > 256"


def split_steps(kernels: list[dict]) -> list[tuple[str, list[dict]]]:
    """``(band, kernels)`` per step of a time-ordered kernel list. A step ends with its sampler
    kernels (one or two), so the first other kernel after them starts the next step; its band is
    its decode launch's padded batch, or ``mixed`` when a prefill ran. Kernels after the last
    sampler form a ``tail``."""
    steps, step = [], []
    for e in kernels + [None]:
        ended = step and kind_of(step[-1]["name"]) == "sampler"
        if e is None or (ended and kind_of(e["name"]) != "sampler"):
            if step:
                steps.append((_band(step) if ended else "tail", step))
            step = []
        if e is not None:
            step.append(e)
    return steps


def _band(step: list[dict]) -> str:
    decode_bs = None
    for k in step:
        if "_unified_attention_kernel" in k["name"]:
            return "mixed"
        if "_decode_split_kernel" in k["name"]:
            decode_bs = k.get("args", {}).get("grid", [0, 0, 0])[1]
    return band_of(decode_bs)


def main() -> None:
    out_json = sys.argv[1] if len(sys.argv) > 1 else None
    # No prefix caching: the profiled run repeats the first one's prompts and must prefill them again.
    llm = LLM("benchmarks/configs/qwen3-0.6b", load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              enable_prefix_caching=False)
    wl = make_workload("nano", 256, (0, 0), (0, 0), 10000, 0)
    run_pagedllm(llm, Workload([wl.prompts[0][:8]], [16]), 0.6)
    t0 = time.perf_counter()
    run_pagedllm(llm, wl, 0.6)
    plain_s = time.perf_counter() - t0
    print(f"unprofiled run {plain_s:.3f} s")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        run_pagedllm(llm, wl, 0.6)
        torch.cuda.synchronize()
        prof_s = time.perf_counter() - t0
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    print(f"profiled run {prof_s:.3f} s, {len(kernels)} kernels")

    by_band_kind = collections.defaultdict(float)  # (band, kind) -> us
    band_steps = collections.Counter()
    by_name = collections.defaultdict(lambda: [0, 0.0])
    mixed_by_name = collections.defaultdict(lambda: [0, 0.0])
    busy_us = 0.0
    for e in kernels:
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += e["dur"]
        busy_us += e["dur"]
    for band, step in split_steps(kernels):
        if band != "tail":
            band_steps[band] += 1
        for k in step:
            by_band_kind[(band, kind_of(k["name"]))] += k["dur"]
            if band == "mixed":
                mixed_by_name[k["name"]][0] += 1
                mixed_by_name[k["name"]][1] += k["dur"]

    shape = ModelShape.from_model(llm.llm_engine.engine_core.runner.model, llm.llm_engine.model_config.hf_config, 2)
    floor = generation_floor(shape, [len(p) for p in wl.prompts], wl.max_tokens, 1.0, 1.0)
    kv_read = floor.as_dict()["kv_read_bytes"]
    attn_us = sum(v for (b, k), v in by_band_kind.items() if k in ("attn decode", "attn reduce"))

    bands = sorted({b for b, _ in by_band_kind}, key=lambda b: (b != "mixed", b))
    kinds = [k for k, _ in KINDS] + ["other"]
    print(f"\nGPU busy {busy_us / 1e6:.3f} s; decode attention {attn_us / 1e6:.3f} s = "
          f"{kv_read / attn_us / 1e6:,.2f} TB/s over the run's KV reads ({kv_read / 1e12:.2f} TB)")
    print("\nseconds by band (rows) and kind (columns):")
    print(f"{'band':>14} {'steps':>5} " + " ".join(f"{k[:12]:>12}" for k in kinds) + f" {'total':>8}")
    table = {}
    for b in bands:
        row = {k: by_band_kind.get((b, k), 0.0) / 1e6 for k in kinds}
        table[b] = {"steps": band_steps[b], **{k: round(v, 4) for k, v in row.items()}, "total": round(sum(row.values()), 4)}
        print(f"{b:>14} {band_steps[b]:>5} " + " ".join(f"{v:>12.3f}" for v in row.values()) + f" {sum(row.values()):>8.3f}")
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:40]
    print("\ntop kernels (total ms, count, kind):")
    for name, (n, us) in top:
        print(f"{us / 1e3:>9.1f} {n:>7}  {kind_of(name):<16} {name[:110]}")
    mixed_top = sorted(mixed_by_name.items(), key=lambda kv: -kv[1][1])[:25]
    print("\ntop kernels of the mixed (prefill) steps (total ms, count, kind):")
    for name, (n, us) in mixed_top:
        print(f"{us / 1e3:>9.1f} {n:>7}  {kind_of(name):<16} {name[:110]}")
    if out_json:
        with open(out_json, "w") as f:
            json.dump({"unprofiled_s": plain_s, "profiled_s": prof_s, "busy_s": busy_us / 1e6,
                       "decode_attention_s": attn_us / 1e6, "kv_read_bytes": kv_read, "bands": table,
                       "top_kernels": [{"name": n, "count": c, "ms": us / 1e3, "kind": kind_of(n)} for n, (c, us) in top],
                       "top_mixed_kernels": [{"name": n, "count": c, "ms": us / 1e3, "kind": kind_of(n)}
                                             for n, (c, us) in mixed_top]},
                      f, indent=1)


if __name__ == "__main__":
    main()
