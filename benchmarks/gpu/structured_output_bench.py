"""Structured output against free generation, one engine, one process (issue 25's workload).

SmolLM2-135M architecture with random bf16 weights and the real SmolLM2 tokenizer (grammars need
one): 256 requests of 256 random-token prompts, ``max_tokens`` 256, temperature 0.8, each either
free or constrained by a nested JSON schema (objects, arrays, enums; ``--schema bounded``
adds string bounds). Runs are alternated
(free, json, free, json, ...) so that drift hits both; prints output tok/s of each, their ratio,
the CPU time spent filling bitmasks per step (and the part of it the engine thread waited for:
the rest overlapped its other work), and the time to first token of a single request with
a cached schema against a free one. Writes JSON to ``--output-json``.

    python benchmarks/gpu/structured_output_bench.py --tokenizer .tok/smollm2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

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


def run(llm, prompts, params) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


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
    bitmask_ms_per_step: list[float] = []
    bitmask_wait_ms_per_step: list[float] = []  # the part the engine thread waited for
    for _ in range(ns.rounds):
        for name, params in (("free", free), ("json", constrained)):
            manager = core.structured_output
            bitmask_before = (manager.bitmask_time_s, manager.num_bitmask_steps, manager.bitmask_wait_s)
            elapsed, produced = run(llm, prompts, params)
            results[name].append(produced / elapsed)
            if name == "json":
                spent = manager.bitmask_time_s - bitmask_before[0]
                steps = manager.num_bitmask_steps - bitmask_before[1]
                bitmask_ms_per_step.append(1e3 * spent / max(steps, 1))
                bitmask_wait_ms_per_step.append(1e3 * (manager.bitmask_wait_s - bitmask_before[2]) / max(steps, 1))
            print(f"{name:5s} {produced:7d} tokens {elapsed:6.2f} s {produced / elapsed:9.0f} tok/s", flush=True)

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
        "bitmask_cpu_ms_per_step": bitmask_ms_per_step,
        "bitmask_wait_ms_per_step": bitmask_wait_ms_per_step,
        "ttft_ms_single_request": ttft,
    }
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
