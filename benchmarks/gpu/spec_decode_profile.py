"""Where a speculative (n-gram) step's time goes against a plain decode step, batch 1, real weights.

The workload of ``spec_decode_bench.py``'s n-gram part (a ~1,000-token passage, then its start
again: greedy decoding copies it). For speculation off and n-gram on, in one engine each:

1. the engine's steps: per step the GPU time (CUDA events around launch .. sampled-id copy), the
   GPU idle time before the next step, the host time to launch, grouped by step kind;
2. the forward graphs alone: CUDA-event time of one replay of the ``(1, 1)`` and ``(1, 1 + k)``
   graphs, and a profiler table of their top kernels per replay (name, calls, us);
3. the host: the engine's phase timings per step and a cProfile of the n-gram run (top functions
   by own time).

Prints tables; writes JSON to ``--output-json``. Usage (repo root, on the device):

    python benchmarks/gpu/spec_decode_profile.py --model /tmp/smollm2.gguf --output-json $OUT/spec_profile.json
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spec_decode_bench import copy_prompt, release, replay_ms  # noqa: E402


def step_summary(rows: list[dict]) -> dict:
    """Mean GPU ms, idle-after ms and host launch ms per step kind (tokens in the step)."""
    groups: dict = collections.defaultdict(list)
    for r in rows:
        groups[f"{r['num_tokens']} tok"].append(r)
    out = {}
    for kind, rs in sorted(groups.items()):
        idle = [r["idle_after_ms"] for r in rs if "idle_after_ms" in r]
        out[kind] = {"steps": len(rs), "gpu_ms": sum(r["gpu_ms"] for r in rs) / len(rs),
                     "idle_after_ms": sum(idle) / max(len(idle), 1),
                     "host_launch_ms": sum(r["host_launch_ms"] for r in rs) / len(rs)}
    return out


def kernel_table(graphs, shape: tuple[int, int], n: int = 10, top: int = 15) -> list[dict]:
    """The kernels of ``n`` replays of the graph of ``shape``, by total time, per replay."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graphs.replay(*shape)
        torch.cuda.synchronize()
    agg: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name][0] += 1
            agg[e.name][1] += e.time_range.elapsed_us()
    rows = [{"kernel": k[:90], "calls": c / n, "us": t / n} for k, (c, t) in agg.items()]
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    return [{"kernel": "TOTAL busy", "calls": sum(r["calls"] for r in rows), "us": total}] + rows[:top]


def run_mode(ns, name: str, spec: dict | None) -> dict:
    import torch

    from pagedllm import LLM, SamplingParams
    from pagedllm.worker.step_handle import StepTrace

    llm = LLM(ns.model, max_model_len=2048, max_num_seqs=16, gpu_memory_utilization=0.4, speculative_config=spec)
    prompt = [{"prompt_token_ids": copy_prompt(llm.get_tokenizer())}]
    params = SamplingParams(temperature=0.0, max_tokens=ns.max_tokens, ignore_eos=True)
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    core = llm.llm_engine.engine_core
    runner = core.runner
    for d in (core.step_timings, runner.timings):
        for k in d:
            d[k] = 0.0
    t0 = time.perf_counter()
    llm.generate(prompt, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    steps = core.step_timings["steps"] or 1
    phases = {k: 1e3 * v / steps for k, v in {**core.step_timings, **runner.timings}.items() if k != "steps"}
    runner.trace = StepTrace()
    llm.generate(prompt, params, use_tqdm=False)
    rows, runner.trace = runner.trace.rows(), None
    host = cProfile.Profile()
    host.enable()
    llm.generate(prompt, params, use_tqdm=False)
    host.disable()
    buf = io.StringIO()
    pstats.Stats(host, stream=buf).sort_stats("tottime").print_stats(25)
    result = {"ms_per_token": 1e3 * wall / ns.max_tokens, "engine_steps": steps, "phase_ms_per_step": phases,
              "steps": step_summary(rows), "cprofile_top": buf.getvalue()}
    graphs = runner.graph_runner
    if graphs is not None:  # last: replays write KV into the finished request's slots
        shapes = sorted(graphs.graphs)
        shapes = [s for s in shapes if s[0] == 1]
        result["graph_replay_ms"] = {f"q={q}": replay_ms(graphs, (1, q)) for _, q in shapes}
        result["graph_kernels"] = {f"q={q}": kernel_table(graphs, (1, q)) for _, q in shapes}
    release(llm)
    torch.cuda.synchronize()
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 (real weights)")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--output-json", default=None)
    ns = ap.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": ns.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    report = {"off": run_mode(ns, "off", None), "ngram": run_mode(ns, "ngram", spec)}
    for name, r in report.items():
        print(f"== {name}: {r['ms_per_token']:.3f} ms/token, {r['engine_steps']} engine steps")
        print("   phases ms/engine step:", {k: round(v, 3) for k, v in r["phase_ms_per_step"].items()})
        for kind, s in r["steps"].items():
            print(f"   {kind:>8}: {s['steps']:4d} steps, gpu {s['gpu_ms']:.3f} ms, idle after {s['idle_after_ms']:.3f} ms, "
                  f"host launch {s['host_launch_ms']:.3f} ms")
        for shape, ms in r.get("graph_replay_ms", {}).items():
            print(f"   graph (1, {shape}) replay: {ms:.3f} ms")
        for shape, table in r.get("graph_kernels", {}).items():
            print(f"   kernels of one replay, {shape}:")
            for row in table:
                print(f"     {row['us']:9.1f} us {row['calls']:6.1f}x  {row['kernel']}")
        print(r["cprofile_top"][:6000])
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
