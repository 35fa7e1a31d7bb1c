"""Jump-forward decoding on and off, one process, one model (structured_output/jump_forward.py).

A schema-heavy workload: every request is constrained by a JSON schema with long fixed keys,
nested objects and enums (compact JSON, ``disable_any_whitespace``, and xgrammar's default that
allows whitespace between tokens). Two engines, one per setting, run the same batch in alternating
rounds (off, on, off, on, ...) so drift hits both; prints per setting the engine steps (non-empty
schedules), wall time, output tokens, jumped tokens and output tok/s, checks every output against
the schema, and writes JSON to ``--output-json``.

    python benchmarks/structured_jump_forward.py                  # the embedded SmolLM2, CPU
    python benchmarks/structured_jump_forward.py --model benchmarks/configs/smollm2-135m \\
        --tokenizer .tok/smollm2 --load-format dummy --num-requests 256   # GPU, random weights
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "customer_identifier": {"type": "integer"},
        "customer_full_name": {"type": "string", "maxLength": 24},
        "account_status": {"enum": ["active", "inactive", "pending_review"]},
        "shipping_address": {
            "type": "object",
            "properties": {"street_name": {"type": "string", "maxLength": 24},
                           "city_name": {"type": "string", "maxLength": 16},
                           "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street_name", "city_name", "postal_code"],
            "additionalProperties": False,
        },
        "preferred_contact_method": {"enum": ["email", "phone", "post"]},
        "is_priority_customer": {"type": "boolean"},
    },
    "required": ["customer_identifier", "customer_full_name", "account_status", "shipping_address",
                 "preferred_contact_method", "is_priority_customer"],
    "additionalProperties": False,
}
PROMPTS = ["Write one customer record as JSON.", "A customer from Rome, in JSON:", "JSON for a new customer:",
           "Customer record (JSON):"]


def run(llm, prompts, params) -> dict:
    core = llm.llm_engine.engine_core
    steps_before, jumped_before = count_steps.total, core.structured_output.num_jumped_tokens
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    valid = 0
    for out in outs:
        try:
            import jsonschema

            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
            valid += 1
        except Exception:  # a request cut by max_tokens is not valid JSON
            pass
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"steps": count_steps.total - steps_before, "seconds": elapsed, "tokens": tokens,
            "jumped": core.structured_output.num_jumped_tokens - jumped_before, "tok_s": tokens / elapsed,
            "valid": valid, "requests": len(outs)}


class count_steps:  # noqa: N801 - a counter namespace
    total = 0

    @classmethod
    def install(cls, llm) -> None:
        scheduler = llm.llm_engine.engine_core.scheduler
        schedule = scheduler.schedule

        def counting():
            out = schedule()
            cls.total += not out.is_empty
            return out

        scheduler.schedule = counting


def main() -> int:
    from pagedllm import LLM, SamplingParams, StructuredOutputsParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output-json", default=None)
    ns = ap.parse_args()

    engines = {jump: LLM(ns.model, tokenizer=ns.tokenizer, load_format=ns.load_format, max_model_len=1024,
                         max_num_seqs=min(256, ns.num_requests), structured_outputs_jump_forward=jump)
               for jump in (False, True)}
    for llm in engines.values():
        count_steps.install(llm)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(ns.num_requests)]
    summary: dict = {"workload": f"{ns.num_requests} requests, max_tokens {ns.max_tokens}, T={ns.temperature}"}
    for compact in (True, False):
        params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, seed=1,
                                structured_outputs=StructuredOutputsParams(json=SCHEMA,
                                                                           disable_any_whitespace=compact))
        for llm in engines.values():
            run(llm, prompts[:2], params)  # warm-up: compiles the grammar (cached after)
        rows: dict[str, list[dict]] = {"off": [], "on": []}
        for _ in range(ns.rounds):
            for jump, llm in engines.items():
                row = run(llm, prompts, params)
                rows["on" if jump else "off"].append(row)
                print(f"{'compact' if compact else 'any-ws':7s} jump={'on ' if jump else 'off'} "
                      f"steps {row['steps']:5d}  {row['seconds']:7.2f} s  tokens {row['tokens']:6d}  "
                      f"jumped {row['jumped']:6d}  {row['tok_s']:7.1f} tok/s  valid {row['valid']}/{row['requests']}",
                      flush=True)
        med = {k: {f: statistics.median(r[f] for r in v) for f in ("steps", "seconds", "tok_s")} for k, v in rows.items()}
        summary["compact" if compact else "any_whitespace"] = {
            "runs": rows, "steps_on_over_off": med["on"]["steps"] / med["off"]["steps"],
            "seconds_on_over_off": med["on"]["seconds"] / med["off"]["seconds"],
            "tok_s_on_over_off": med["on"]["tok_s"] / med["off"]["tok_s"],
        }
    print(json.dumps({k: v for k, v in summary.items()}, indent=1, default=str))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(summary, f, indent=1)
    for llm in engines.values():
        llm.llm_engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
