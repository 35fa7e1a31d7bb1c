"""Where the GPU sits idle during steady decode: trace a few engine steps and list the gaps.

Runs the engine on random weights until every request decodes, times ``--steps`` steps without the
profiler, then traces them (torch profiler, CUDA activities; CUDA-graph kernels appear one by one)
and reports per step: wall time, the time some kernel or copy was running, and the largest idle
gaps grouped by the pair of kernels around them. The profiler itself adds a little host time, so
gaps are an upper bound; ratios between runs of this script are what to compare.

Usage (repo root, on the device):
  ``python benchmarks/gpu/trace_gaps.py --model benchmarks/configs/llama-3.1-8b --batch 64 --ctx 1024``
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def short(name: str) -> str:
    return name if len(name) <= 48 else name[:45] + "..."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--min-gap-us", type=float, default=3.0)
    ap.add_argument("--out", default=None, help="write the summary as JSON here")
    ns = ap.parse_args()
    import torch  # noqa: PLC0415

    from pagedllm import LLM, SamplingParams  # noqa: PLC0415

    llm = LLM(ns.model, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096)
    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=ns.temperature, max_tokens=4096 - ns.ctx, ignore_eos=True, detokenize=False)
    for i in range(ns.batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": [rng.randint(0, 10000) for _ in range(ns.ctx)]}, params)
    budget = engine.config.scheduler_config.max_num_batched_tokens
    for _ in range(ns.batch * ns.ctx // budget + 8):
        engine.step()  # every prompt prefilled, a few decode steps done
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(ns.steps):
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / ns.steps * 1e3

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(ns.steps):
            engine.step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                 key=lambda e: e["ts"])
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    busy, gaps, end, prev = 0.0, collections.defaultdict(lambda: [0, 0.0]), gpu[0]["ts"], "(start)"
    gap_spans = []
    for e in gpu:
        start, stop = e["ts"], e["ts"] + e["dur"]
        if start > end:
            gap = start - end
            if gap >= ns.min_gap_us:
                slot = gaps[(short(prev), short(e["name"]))]
                slot[0] += 1
                slot[1] += gap
                gap_spans.append((end, start))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, prev = stop, e["name"]
    per_step = lambda us: us / ns.steps / 1e3  # noqa: E731
    idle = span - busy
    print(f"{Path(ns.model).name} batch {ns.batch} ctx ~{ns.ctx}: wall {wall_ms:.3f} ms/step unprofiled | "
          f"traced span {per_step(span):.3f} ms/step, GPU busy {per_step(busy):.3f}, idle {per_step(idle):.3f} "
          f"({len(gpu) / ns.steps:.0f} kernels+copies/step)")
    top = sorted(gaps.items(), key=lambda kv: -kv[1][1])[:15]
    print(f"{'idle ms/step':>12} {'count/step':>10}  after -> before")
    for (a, b), (count, total) in top:
        print(f"{per_step(total):12.4f} {count / ns.steps:10.1f}  {a} -> {b}")
    # What the host was doing while the GPU waited: host ops and CUDA runtime calls overlapping gaps.
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime") and "dur" in e]
    during = collections.defaultdict(float)
    for e in host:
        a, b = e["ts"], e["ts"] + e["dur"]
        for g0, g1 in gap_spans:
            if a < g1 and b > g0:
                during[f"{e['cat']}: {short(e['name'])}"] += min(b, g1) - max(a, g0)
    print("host activity overlapping those gaps (ms/step; nested ops overlap):")
    for name, total in sorted(during.items(), key=lambda kv: -kv[1])[:14]:
        print(f"{per_step(total):12.4f}  {name}")
    calls = collections.defaultdict(list)
    for e in host:
        if e["cat"] == "cuda_runtime":
            calls[e["name"]].append(e["dur"])
    print("CUDA runtime calls (per step: count, total ms; mean / max us):")
    for name, durs in sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:8]:
        print(f"  {short(name):48s} {len(durs) / ns.steps:6.1f} {per_step(sum(durs)):8.3f}   "
              f"{sum(durs) / len(durs):8.1f} / {max(durs):8.1f}")
    # Does launching a graph wait for its previous replay? Time back-to-back replays on the host.
    runner = engine.engine_core.runner
    size = runner.graph_runner.padded_size(ns.batch)
    if size is not None:
        torch.cuda.synchronize()
        host_us = []
        for _ in range(8):
            t = time.perf_counter()
            runner.graph_runner.replay(size)
            host_us.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        print("host time of 8 back-to-back replay() calls (us):", " ".join(f"{x:.0f}" for x in host_us))
    small = sum(per_step(t) for (_, (c, t)) in gaps.items())
    print(f"gaps >= {ns.min_gap_us} us: {small:.3f} ms/step; smaller gaps: {per_step(idle) - small:.3f} ms/step")
    if ns.out:
        Path(ns.out).write_text(json.dumps(dict(
            model=ns.model, batch=ns.batch, ctx=ns.ctx, wall_ms=wall_ms, span_ms=per_step(span),
            busy_ms=per_step(busy), idle_ms=per_step(idle),
            top_gaps=[dict(after=a, before=b, count_per_step=c / ns.steps, ms_per_step=per_step(t))
                      for (a, b), (c, t) in top]), indent=1))


if __name__ == "__main__":
    main()
