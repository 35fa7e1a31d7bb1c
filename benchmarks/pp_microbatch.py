"""Pipeline parallel on the CPU: PP=2 (two gloo worker processes, one thread each) with two
micro-batches in flight (the engine core's batch queue) against one batch in flight
(``EngineCore.set_max_micro_batches(1)``: the stages take turns), and one process with one thread
for scale. Random weights of a ``benchmarks/configs`` model, a decode-heavy workload (all requests
at once); the figure is output tokens per second of the whole run, best of ``--repeats``.

    python benchmarks/pp_microbatch.py [--model smollm2-135m] [--requests 64] [--prompt-len 32]
        [--output-len 32] [--repeats 2]

Not part of CI. Prints a table; writes ``$OUT/pp_microbatch.json`` when ``OUT`` is set. On a
shared or busy host the two ranks compete for cores (then the stages cannot run side by side and
the ratio says little); the workers' CPU time per token shows what the smaller micro-batches cost.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's pagedllm
os.environ.setdefault("PAGEDLLM_CPU_THREADS", "2")  # the workers split it: one thread per rank

import torch  # noqa: E402

from pagedllm import EngineArgs, LLMEngine, SamplingParams  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(__file__), "configs")


def build(model: str, pp: int, num_requests: int) -> LLMEngine:
    args = EngineArgs(os.path.join(CONFIGS, model), load_format="dummy", skip_tokenizer_init=True, dtype="float32", device="cpu",
                      max_model_len=512, max_num_seqs=num_requests, max_num_batched_tokens=512,
                      pipeline_parallel_size=pp, seed=0)
    return LLMEngine.from_engine_args(args)


def timed_run(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> float:
    """Seconds to generate ``output_len`` tokens for every prompt, all added at once."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{time.perf_counter_ns()}-{i}", {"prompt_token_ids": prompt}, params)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def worker_cpu_seconds(engine: LLMEngine) -> float:
    """CPU seconds the worker processes have used so far (Linux /proc; 0 without workers)."""
    total = 0.0
    for proc in getattr(engine.engine_core.executor, "procs", []):
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def measure(engine: LLMEngine, prompts: list[list[int]], output_len: int, repeats: int) -> tuple[float, float]:
    """Output tokens/s of the best run, and the workers' CPU seconds per output token in it."""
    timed_run(engine, prompts[:2], 4)  # warm-up
    runs = []
    for _ in range(repeats):
        cpu0 = worker_cpu_seconds(engine)
        runs.append((timed_run(engine, prompts, output_len), worker_cpu_seconds(engine) - cpu0))
    seconds, cpu = min(runs)
    num_tokens = len(prompts) * output_len
    return num_tokens / seconds, cpu / num_tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ns = ap.parse_args()
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(ns.prompt_len)] for i in range(ns.requests)]
    rows = []
    engine = build(ns.model, 2, ns.requests)
    try:
        core = engine.engine_core
        for depth in (2, 1):
            core.set_max_micro_batches(depth)
            tok_s, cpu_per_token = measure(engine, prompts, ns.output_len, ns.repeats)
            stats = core.micro_batch_stats
            rows.append({"layout": f"PP=2, {depth} micro-batch(es) in flight", "pp": 2, "micro_batches": depth,
                         "output_tok_s": tok_s, "worker_cpu_ms_per_token": cpu_per_token * 1e3,
                         "launched_behind_another": stats["launched_behind_another"]})
    finally:
        engine.shutdown()
    torch.set_num_threads(1)
    engine = build(ns.model, 1, ns.requests)
    torch.set_num_threads(1)
    try:
        rows.append({"layout": "one process, 1 thread", "pp": 1, "micro_batches": 1,
                     "output_tok_s": measure(engine, prompts, ns.output_len, ns.repeats)[0]})
    finally:
        engine.shutdown()
    base = rows[1]["output_tok_s"]
    print(f"\n{ns.model}: {ns.requests} requests, {ns.prompt_len} in, {ns.output_len} out (float32, CPU)")
    print("| layout | output tok/s | vs one batch in flight | workers' CPU ms / token |\n|---|---|---|---|")
    for row in rows:
        cpu = row.get("worker_cpu_ms_per_token")
        print(f"| {row['layout']} | {row['output_tok_s']:.1f} | {row['output_tok_s'] / base:.2f}x | "
              f"{'' if cpu is None else f'{cpu:.2f}'} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "pp_microbatch.json"), "w") as f:
            json.dump({"model": ns.model, "requests": ns.requests, "prompt_len": ns.prompt_len,
                       "output_len": ns.output_len, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
