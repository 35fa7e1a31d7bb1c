"""Structured output against free generation, one engine, one process (issue 25's workload).

SmolLM2-135M architecture with random bf16 weights and the real SmolLM2 tokenizer (grammars need
one): 256 requests of 256 random-token prompts, ``max_tokens`` 256, temperature 0.8, each either
free or constrained by a nested JSON schema (objects, arrays, enums; ``--schema bounded``
adds string bounds). Runs are alternated
(free, json, free, json, ...) so that drift hits both; prints output tok/s of each, their ratio,
the CPU time spent filling bitmasks per step (and the part of it the engine thread waited for:
the rest overlapped its other work), and the time to first token of a single request with
a cached schema against a free one. Writes JSON to ``--output-json``.

Per run it also reports the engine thread's time per step (wall, CPU, and the EngineCore phases).
``--profile-tokens K`` then runs each mode once more, with ``max_tokens`` K, under the torch
profiler with the engine's calls labelled, and prints where the GPU idles: its busy share of the
decode steps, and which engine call the engine thread was in while the GPU had nothing to run.

    python benchmarks/gpu/structured_output_bench.py --tokenizer .tok/smollm2 --rounds 3
    python benchmarks/gpu/structured_output_bench.py --tokenizer .tok/smollm2 --rounds 1 \
        --profile-tokens 48 --output-json $OUT/so.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from contextlib import contextmanager

# The shape: nested objects, arrays and enums.
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "status": {"type": "string", "enum": ["active", "inactive", "pending"]},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string"}},
            "required": ["street", "city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c", "d"]}, "maxItems": 8},
        "scores": {"type": "array", "items": {"type": "number"}},
        "notes": {"type": "string"},
    },
    "required": ["id", "name", "status", "address", "tags", "scores", "notes"],
}
# The same with bounded strings (maxLength, a pattern): xgrammar's counted repetition makes the
# masks of states inside such a string depend on the count, so a fill there scans the vocabulary
# (tens of milliseconds for one request on one core).
BOUNDED_SCHEMA = {**NESTED_SCHEMA, "properties": {
    **NESTED_SCHEMA["properties"],
    "name": {"type": "string", "maxLength": 40},
    "address": {**NESTED_SCHEMA["properties"]["address"], "properties": {
        "street": {"type": "string"}, "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
}}
SCHEMAS = {"nested": NESTED_SCHEMA, "bounded": BOUNDED_SCHEMA}


def workload(n: int, prompt_len: int, vocab_limit: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_limit) for _ in range(prompt_len)] for _ in range(n)]


def run(llm, prompts, params, step_stats: list | None = None) -> tuple[float, int]:
    """Generate; appends {wall, engine_cpu, schedule, execute, update} ms per step to ``step_stats``."""
    core = llm.llm_engine.engine_core
    before = dict(core.step_timings)
    t0, cpu0 = time.perf_counter(), time.thread_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    if step_stats is not None:
        steps = max(core.step_timings["steps"] - before["steps"], 1)
        phases = {k: 1e3 * (core.step_timings[k] - before[k]) / steps for k in ("schedule", "execute", "update")}
        step_stats.append({"steps": steps, "wall": 1e3 * elapsed / steps, "engine_cpu": 1e3 * cpu / steps, **phases})
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def ab_run(llm, prompts, params, name: str, results: dict, step_stats: dict) -> None:
    """One more run under ``name`` (a variant of the constrained workload), printed like the others."""
    results[name], step_stats[name] = [], []
    try:
        elapsed, produced = run(llm, prompts, params, step_stats[name])
    except Exception as e:  # a variant that fails leaves the main numbers standing
        print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
        return
    results[name].append(produced / elapsed)
    per_step = ", ".join(f"{k} {v:.2f}" for k, v in step_stats[name][-1].items() if k != "steps")
    print(f"{name}: {produced / elapsed:9.0f} tok/s (ms per step: {per_step})", flush=True)


@contextmanager
def short_switch_interval_during_jobs(manager, interval_s: float):
    """Lower ``sys.setswitchinterval`` from each fill job's start to its finish."""
    import sys

    default = sys.getswitchinterval()
    start, finish = manager.start_bitmask, manager.finish_bitmask

    def start_short(*args):
        job = start(*args)
        if job is not None:
            sys.setswitchinterval(interval_s)
        return job

    def finish_default(job):
        try:
            return finish(job)
        finally:
            sys.setswitchinterval(default)

    manager.start_bitmask, manager.finish_bitmask = start_short, finish_default
    try:
        yield
    finally:
        vars(manager).pop("start_bitmask", None)
        vars(manager).pop("finish_bitmask", None)
        sys.setswitchinterval(default)


@contextmanager
def yield_before_schedule(core, sleep_s: float):
    """Sleep ``sleep_s`` (releasing the GIL) before each schedule while a fill job is in flight."""
    schedule = core.scheduler.schedule

    def yielding():
        if core._unsampled is not None:
            time.sleep(sleep_s)
        return schedule()

    core.scheduler.schedule = yielding
    try:
        yield
    finally:
        vars(core.scheduler).pop("schedule", None)


@contextmanager
def immediate_accepts():
    """Accept each token into its matcher in the scheduler's update, one xgrammar call per token on
    the engine thread (the order before the fill job applied the deferred tokens)."""
    from pagedllm.structured_output import StructuredOutputRequest

    accept = StructuredOutputRequest.accept_tokens
    StructuredOutputRequest.accept_tokens = lambda self, token_ids: accept(self, token_ids) and self.matcher is not None
    try:
        yield
    finally:
        StructuredOutputRequest.accept_tokens = accept


@contextmanager
def labelled_engine_calls(llm):
    """Label the engine's calls for the profiler (record_function ranges on the engine thread)."""
    import torch

    from pagedllm.worker.step_handle import StepHandle

    core = llm.llm_engine.engine_core
    targets = [(core.scheduler, "schedule", "schedule"), (core.scheduler, "update_from_output", "update"),
               (core.executor, "execute_model", "execute"), (core.executor, "sample_tokens", "sample_launch"),
               (llm.llm_engine.output_processor, "process_outputs", "output")]
    if core.structured_output is not None:
        targets += [(core.structured_output, "start_bitmask", "start_bitmask"),
                    (core.structured_output, "finish_bitmask", "finish_bitmask")]

    def label(fn, name):
        def call(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return call

    for obj, attr, name in targets:
        setattr(obj, attr, label(getattr(obj, attr), name))
    result = StepHandle.result
    StepHandle.result = label(result, "wait_result")
    try:
        yield
    finally:
        StepHandle.result = result
        for obj, attr, _ in targets:
            vars(obj).pop(attr, None)


def gpu_idle_summary(trace: dict) -> dict:
    """From a Chrome trace: the GPU's busy share over the middle 80% of its activity, the engine
    calls' mean durations, and for the GPU's idle time, which labelled call the engine thread was in."""
    events = trace["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    labels = [e for e in events if e.get("cat") == "user_annotation" and "dur" in e]
    if not kernels:
        return {}
    first, last = kernels[0][0], max(end for _, end in kernels)
    lo, hi = first + 0.1 * (last - first), last - 0.1 * (last - first)
    busy, gaps, cur_start, cur_end = 0.0, [], None, None
    for start, end in kernels:
        if end < lo or start > hi:
            continue
        start, end = max(start, lo), min(end, hi)
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
                gaps.append((cur_end, start))
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    idle_in: dict[str, float] = {}  # GPU gaps of 5 us or more, by the engine call they fell in
    for gap_start, gap_end in gaps:
        if gap_end - gap_start < 5:  # launch latency between queued kernels, not an empty queue
            continue
        covered = 0.0
        for e in labels:
            overlap = min(gap_end, e["ts"] + e["dur"]) - max(gap_start, e["ts"])
            if overlap > 0 and e["name"] in LEAF_LABELS:
                idle_in[e["name"]] = idle_in.get(e["name"], 0.0) + overlap
                covered += overlap
        idle_in["(none)"] = idle_in.get("(none)", 0.0) + max(0.0, gap_end - gap_start - covered)
    calls: dict[str, list[float]] = {}
    for e in labels:
        if lo <= e["ts"] <= hi:
            calls.setdefault(e["name"], []).append(e["dur"])
    window = hi - lo
    return {"gpu_busy_share": busy / window, "window_ms": window / 1e3,
            "gpu_idle_ms_in_call": {k: round(v / 1e3, 3) for k, v in sorted(idle_in.items(), key=lambda kv: -kv[1])},
            "call_mean_us": {k: round(statistics.mean(v), 1) for k, v in calls.items()},
            "call_count": {k: len(v) for k, v in calls.items()}}


# Labels that do not nest inside one another (a step's calls; wait_result runs inside no other label).
LEAF_LABELS = ("schedule", "update", "execute", "sample_launch", "output", "start_bitmask", "finish_bitmask",
               "wait_result")


def profile_modes(llm, prompts, modes: dict, max_tokens: int, out_dir: str | None) -> dict:
    """One run per mode under the torch profiler; the idle summary of each."""
    import torch

    summaries = {}
    for name, params in modes.items():
        short = params.clone()
        short.max_tokens = max_tokens
        with labelled_engine_calls(llm), torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            run(llm, prompts, short)
        path = os.path.join(out_dir or ".", f"trace_{name}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        os.remove(path)  # tens of MB: the summary is what is kept
        summaries[name] = gpu_idle_summary(trace)
        print(name, json.dumps(summaries[name]), flush=True)
    return summaries


def main() -> int:
    from pagedllm import LLM, SamplingParams
    from pagedllm.sampling_params import StructuredOutputsParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="benchmarks/configs/smollm2-135m")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--schema", choices=sorted(SCHEMAS), default="nested")
    ap.add_argument("--ab-immediate-accepts", action="store_true",
                    help="also run the constrained workload with each accept applied at once on the engine "
                         "thread (as before the fill job took them over): the gain of deferring them")
    ap.add_argument("--ab-switch-interval-us", type=float, default=0,
                    help="also run the constrained workload with the interpreter's switch interval lowered to "
                         "this while each fill job runs (its thread then gets the GIL between its two xgrammar "
                         "calls without waiting for the engine thread to block)")
    ap.add_argument("--ab-yield-us", type=float, default=0,
                    help="also run the constrained workload with the engine thread sleeping this long before "
                         "each schedule while a fill job runs (handing the job the GIL between its two calls)")
    ap.add_argument("--profile-tokens", type=int, default=0,
                    help="then profile one run per mode with this max_tokens (0: no profile)")
    ns = ap.parse_args()

    llm = LLM(ns.model, tokenizer=ns.tokenizer, load_format="dummy", max_model_len=1024)
    prompts = workload(ns.num_requests, ns.prompt_len, 10000)
    free = SamplingParams(max_tokens=ns.max_tokens, temperature=0.8, seed=1, ignore_eos=True)
    constrained = SamplingParams(max_tokens=ns.max_tokens, temperature=0.8, seed=1,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMAS[ns.schema]))
    run(llm, prompts[:16], free)  # warm-up: compiles, graphs, the schema's grammar (cached after)
    run(llm, prompts[:16], constrained)
    core = llm.llm_engine.engine_core
    results: dict[str, list[float]] = {"free": [], "json": []}
    step_stats: dict[str, list[dict]] = {"free": [], "json": []}
    bitmask_ms_per_step: list[float] = []
    bitmask_wait_ms_per_step: list[float] = []  # the part the engine thread waited for
    for _ in range(ns.rounds):
        for name, params in (("free", free), ("json", constrained)):
            manager = core.structured_output
            bitmask_before = (manager.bitmask_time_s, manager.num_bitmask_steps, manager.bitmask_wait_s)
            elapsed, produced = run(llm, prompts, params, step_stats[name])
            results[name].append(produced / elapsed)
            if name == "json":
                spent = manager.bitmask_time_s - bitmask_before[0]
                steps = manager.num_bitmask_steps - bitmask_before[1]
                bitmask_ms_per_step.append(1e3 * spent / max(steps, 1))
                bitmask_wait_ms_per_step.append(1e3 * (manager.bitmask_wait_s - bitmask_before[2]) / max(steps, 1))
            per_step = ", ".join(f"{k} {v:.2f}" for k, v in step_stats[name][-1].items() if k != "steps")
            print(f"{name:5s} {produced:7d} tokens {elapsed:6.2f} s {produced / elapsed:9.0f} tok/s "
                  f"(ms per step: {per_step})", flush=True)

    if ns.ab_immediate_accepts:
        with immediate_accepts():
            ab_run(llm, prompts, constrained, "json_immediate_accepts", results, step_stats)

    if ns.ab_switch_interval_us:
        with short_switch_interval_during_jobs(core.structured_output, ns.ab_switch_interval_us / 1e6):
            ab_run(llm, prompts, constrained, "json_short_switch_interval", results, step_stats)

    if ns.ab_yield_us:
        with yield_before_schedule(core, ns.ab_yield_us / 1e6):
            ab_run(llm, prompts, constrained, "json_yield_before_schedule", results, step_stats)

    ttft = {}
    for name, params in (("free", free), ("json", constrained)):
        one = params.clone()
        one.max_tokens = 1
        times = []
        for i in range(5):
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompts[i]}], one, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        ttft[name] = statistics.median(times) * 1e3

    free_med, json_med = statistics.median(results["free"]), statistics.median(results["json"])
    summary = {
        "workload": f"{ns.num_requests} x {ns.prompt_len} random tokens, max_tokens {ns.max_tokens}, T=0.8, "
                    f"{ns.schema} JSON schema",
        "free_tok_s": results["free"], "json_tok_s": results["json"],
        "ratio_json_over_free": json_med / free_med,
        **{f"ratio_{name}_over_free": r[0] / free_med for name, r in results.items()
           if name not in ("free", "json") and r},
        "bitmask_cpu_ms_per_step": bitmask_ms_per_step,
        "bitmask_wait_ms_per_step": bitmask_wait_ms_per_step,
        "ttft_ms_single_request": ttft,
        "ms_per_step": step_stats,
    }
    if ns.profile_tokens:
        out_dir = os.path.dirname(ns.output_json) if ns.output_json else None
        try:
            summary["profile"] = profile_modes(llm, prompts, {"free": free, "json": constrained}, ns.profile_tokens,
                                               out_dir)
        except Exception as e:  # the throughput numbers above still stand
            print(f"profile failed: {type(e).__name__}: {e}", flush=True)
            summary["profile_error"] = repr(e)
    print(json.dumps(summary, indent=1))
    print("| free tok/s | json tok/s | ratio | bitmask ms/step | waited ms/step | TTFT free / json ms |")
    print(f"| {free_med:.0f} | {json_med:.0f} | {json_med / free_med:.3f} | "
          f"{statistics.median(bitmask_ms_per_step) if bitmask_ms_per_step else float('nan'):.3f} | "
          f"{statistics.median(bitmask_wait_ms_per_step) if bitmask_wait_ms_per_step else float('nan'):.3f} | "
          f"{ttft['free']:.1f} / {ttft['json']:.1f} |")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
