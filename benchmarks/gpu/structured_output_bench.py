"""Structured output against free generation, one engine, one process (issue 25's workload).

SmolLM2-135M architecture with random bf16 weights and the real SmolLM2 tokenizer (grammars need
one): 256 requests of 256 random-token prompts, ``max_tokens`` 256, temperature 0.8, each either
free or constrained by a nested JSON schema (objects, arrays, enums; ``--schema bounded``
adds string bounds). Runs are alternated
(free, json, free, json, ...) so that drift hits both; prints output tok/s of each, their ratio,
the CPU time spent filling bitmasks per step (and the part of it the engine thread waited for:
the rest overlapped its other work), and the time to first token of a single request with
a cached schema against a free one. Writes JSON to ``--output-json`` (default
``$OUT/structured_output_bench.json`` when ``$OUT`` is set).

Each run also reports the engine thread's wall time per step in each engine call (schedule,
execute launch, sample launch, wait for the step's tokens, scheduler update, accepting the
grammar's tokens, starting and waiting for the bitmask fill, output processing): the host-side
breakdown of a free and a constrained step. ``--ab`` adds constrained runs with one mechanism
undone, alternated with the others, to measure what each gives:
- ``json-main``: tokens accepted one by one in the scheduler's update and the bitmask copied from
  pageable memory (main's order before the batched accepts and the pinned copy);
- ``json-helpers``: the batched accept split over 7 helper threads and the engine thread;
- ``json-fill15`` / ``json-fill2``: 15 or 2 bitmask fill threads instead of ``MAX_FILL_THREADS``;
- ``json-fillthread-si``: the tokens accepted on the fill thread right before the fill (off the
  engine thread, but that thread needs the GIL between the two calls) with a 0.2 ms GIL switch
  interval meanwhile.

Tok/s are summarised by the median and the best of the rounds (``--rounds`` 2 or more: the host
is noisy); a full free run and a full constrained run warm up first.

    python benchmarks/gpu/structured_output_bench.py --tokenizer .tok/smollm2 --rounds 2 --ab
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's pagedllm first

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


def run(llm, prompts, params) -> tuple[float, int, dict[str, float]]:
    """Generate; the seconds, the output tokens and the engine thread's ms per step in each call."""
    with timed_engine_calls(llm) as seconds:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    steps = max(seconds.pop("steps"), 1)
    per_step = {"wall": 1e3 * elapsed / steps, **{k: 1e3 * v / steps for k, v in seconds.items()}}
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs), per_step


@contextmanager
def timed_engine_calls(llm):
    """Sum the wall time of the engine's calls (by phase name) and count the steps."""
    from pagedllm.worker.step_handle import StepHandle

    engine = llm.llm_engine
    core = engine.engine_core
    manager = core.structured_output
    seconds = dict.fromkeys(("schedule", "execute", "sample_launch", "wait_tokens", "update", "accept",
                             "start_bitmask", "finish_bitmask", "output"), 0.0)
    seconds["steps"] = 0
    targets = [(core.scheduler, "schedule", "schedule"), (core.scheduler, "update_from_output", "update"),
               (core.executor, "execute_model", "execute"), (core.executor, "sample_tokens", "sample_launch"),
               (engine.output_processor, "process_outputs", "output"), (core, "step", "steps")]
    if manager is not None:
        targets += [(manager, "start_bitmask", "start_bitmask"), (manager, "finish_bitmask", "finish_bitmask")]
        accept_before = manager.accept_time_s

    def timed(fn, name):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if name == "steps":
                    seconds["steps"] += 1
                else:
                    seconds[name] += time.perf_counter() - t0
        return call

    for obj, attr, name in targets:
        setattr(obj, attr, timed(getattr(obj, attr), name))
    result = StepHandle.result
    StepHandle.result = timed(result, "wait_tokens")
    try:
        yield seconds
    finally:
        StepHandle.result = result
        for obj, attr, _ in targets:
            vars(obj).pop(attr, None)
        if manager is not None:
            seconds["accept"] = manager.accept_time_s - accept_before  # inside start_bitmask


@contextmanager
def accepts_in_the_update():
    """Each token accepted into its matcher in the scheduler's update, one xgrammar call per token
    on the engine thread (main's order before the batched accepts)."""
    from pagedllm.structured_output import StructuredOutputRequest

    accept = StructuredOutputRequest.accept_tokens
    StructuredOutputRequest.accept_tokens = lambda self, token_ids: accept(self, token_ids) and self.matcher is not None
    try:
        yield
    finally:
        StructuredOutputRequest.accept_tokens = accept


@contextmanager
def backend_threads(manager, accept: int | None = None, fill: int | None = None):
    """Other numbers of accept helper threads or bitmask fill threads (the fill pool is rebuilt)."""
    backend = manager.backend
    before = backend.accept_threads, backend.fill_threads, backend._batch
    if accept is not None:
        backend.accept_threads = accept
    if fill is not None:
        backend.fill_threads, backend._batch = fill, None
    try:
        yield
    finally:
        backend.accept_threads, backend.fill_threads, backend._batch = before


@contextmanager
def pageable_bitmask_copy(llm):
    """The bitmask copied to the GPU from pageable memory (main's copy before the pinned staging)."""
    import numpy as np
    import torch
    import xgrammar as xgr

    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    applier = runner.bitmask_applier

    def apply(logits, rows, bitmask):
        words = np.full((logits.shape[0], bitmask.shape[1]), -1, dtype=np.int32)
        words[rows] = bitmask[: len(rows)]
        mask = torch.from_numpy(words).to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(logits.shape[-1], words.shape[1] * 32))

    applier.apply = apply
    try:
        yield
    finally:
        vars(applier).pop("apply", None)


@contextmanager
def accepts_on_fill_thread(manager, switch_interval_s: float | None = None):
    """The step's tokens accepted on the fill thread before its fill (manager.accepts_on_fill_thread);
    with ``switch_interval_s``, ``sys.setswitchinterval`` lowered meanwhile, so that the fill
    thread, back from the accept, gets the GIL from the busy engine thread sooner."""
    before = sys.getswitchinterval()
    manager.accepts_on_fill_thread = True
    if switch_interval_s is not None:
        sys.setswitchinterval(switch_interval_s)
    try:
        yield
    finally:
        manager.accepts_on_fill_thread = False
        sys.setswitchinterval(before)


def variants(llm, ab: bool) -> dict:
    """name -> a function giving the context managers of that variant (constrained ones start "json")."""
    manager = llm.llm_engine.engine_core.structured_output
    out = {"free": list, "json": list}
    if ab:
        out["json-main"] = lambda: [accepts_in_the_update(), pageable_bitmask_copy(llm)]
        out["json-helpers"] = lambda: [backend_threads(manager, accept=7)]
        out["json-fill15"] = lambda: [backend_threads(manager, fill=15)]
        out["json-fill2"] = lambda: [backend_threads(manager, fill=2)]
        out["json-fillthread-si"] = lambda: [accepts_on_fill_thread(manager, 0.0002)]
    return out


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
    ap.add_argument("--ab", action="store_true", help="also the constrained variants with one mechanism undone")
    ns = ap.parse_args()
    if ns.output_json is None and os.environ.get("OUT"):
        ns.output_json = os.path.join(os.environ["OUT"], "structured_output_bench.json")

    llm = LLM(ns.model, tokenizer=ns.tokenizer, load_format="dummy", max_model_len=1024)
    prompts = workload(ns.num_requests, ns.prompt_len, 10000)
    free = SamplingParams(max_tokens=ns.max_tokens, temperature=0.8, seed=1, ignore_eos=True)
    constrained = SamplingParams(max_tokens=ns.max_tokens, temperature=0.8, seed=1,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMAS[ns.schema]))
    run(llm, prompts[:16], free)  # warm-up: compiles, graphs, the schema's grammar (cached after)
    run(llm, prompts[:16], constrained)
    run(llm, prompts, free)  # full height: the sampler's and the bitmask's buffers, the kernels
    run(llm, prompts, constrained)
    manager = llm.llm_engine.engine_core.structured_output
    modes = variants(llm, ns.ab)
    results: dict[str, list[float]] = {name: [] for name in modes}
    phases: dict[str, list[dict]] = {name: [] for name in modes}
    bitmask_ms_per_step: list[float] = []
    bitmask_wait_ms_per_step: list[float] = []  # the part the engine thread waited for
    for _ in range(ns.rounds):
        for name, contexts in modes.items():
            params = free if name == "free" else constrained
            bitmask_before = (manager.bitmask_time_s, manager.num_bitmask_steps, manager.bitmask_wait_s)
            try:
                with ExitStack() as stack:
                    for context in contexts():
                        stack.enter_context(context)
                    elapsed, produced, per_step = run(llm, prompts, params)
            except Exception as e:  # a variant that fails leaves the others standing
                print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
                if name in ("free", "json"):
                    raise
                continue
            results[name].append(produced / elapsed)
            phases[name].append(per_step)
            if name == "json":
                spent = manager.bitmask_time_s - bitmask_before[0]
                steps = manager.num_bitmask_steps - bitmask_before[1]
                bitmask_ms_per_step.append(1e3 * spent / max(steps, 1))
                bitmask_wait_ms_per_step.append(1e3 * (manager.bitmask_wait_s - bitmask_before[2]) / max(steps, 1))
            cells = " ".join(f"{k} {v:.2f}" for k, v in per_step.items())
            print(f"{name:13s} {produced:7d} tokens {elapsed:6.2f} s {produced / elapsed:9.0f} tok/s | ms/step: {cells}",
                  flush=True)

    ttft = {}
    for name, params in (("free", free), ("json", constrained)):
        one = params.clone()
        one.max_tokens = 1
        times = []
        for i in range(min(5, len(prompts))):
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompts[i]}], one, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        ttft[name] = statistics.median(times) * 1e3

    medians = {name: statistics.median(v) for name, v in results.items() if v}
    free_med, json_med = medians["free"], medians["json"]
    summary = {
        "workload": f"{ns.num_requests} x {ns.prompt_len} random tokens, max_tokens {ns.max_tokens}, T=0.8, "
                    f"{ns.schema} JSON schema",
        "free_tok_s": results["free"], "json_tok_s": results["json"],
        "ratio_json_over_free": json_med / free_med,
        "variants_tok_s": results,
        "ratio_over_free": {name: m / free_med for name, m in medians.items()},
        "ratio_of_best_over_best_free": {name: max(v) / max(results["free"]) for name, v in results.items() if v},
        "engine_ms_per_step": {name: {k: statistics.median(p[k] for p in runs) for k in runs[0]}
                               for name, runs in phases.items() if runs},
        "bitmask_cpu_ms_per_step": bitmask_ms_per_step,
        "bitmask_wait_ms_per_step": bitmask_wait_ms_per_step,
        "ttft_ms_single_request": ttft,
    }
    print(json.dumps(summary, indent=1))
    names = list(summary["engine_ms_per_step"]["free"])
    print("| variant | tok/s (median) | ratio | best tok/s | best ratio | " + " | ".join(names) + " |")
    for name, m in medians.items():
        row = summary["engine_ms_per_step"][name]
        best = max(results[name])
        print(f"| {name} | {m:.0f} | {m / free_med:.3f} | {best:.0f} | {best / max(results['free']):.3f} | "
              + " | ".join(f"{row[k]:.2f}" for k in names) + " |")
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
