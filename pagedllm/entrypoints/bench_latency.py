"""Decode latency: per-step decode time at one batch size, against its floor.

A batch of ``--batch-size`` random prompts of ``--input-len`` tokens generates ``--output-len``
tokens each (greedy, ignore_eos). The decode step time is measured as in the vLLM anchor script:
(time for output_len tokens - time for 1 token) / (output_len - 1), best of ``--repeats``. Its
floor: all weights plus the KV cache at the mean context read once per step, over the copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time

from pagedllm.sampling_params import SamplingParams


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--extra-batch-sizes", type=int, nargs="*", default=[1], help="also time these batch sizes")
    p.add_argument("--output-json", default=None)


def _timed(llm, prompts: list[list[int]], n: int) -> float:
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, detokenize=False)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t0


def decode_step_seconds(llm, make_prompts, output_len: int, repeats: int) -> tuple[float, float, float]:
    """Every timed run gets fresh prompts, so no run is helped by the prefix cache and every run
    pays the same prefill; a first untimed run compiles whatever kernels these shapes need."""
    _timed(llm, make_prompts(), 2)
    t1 = min(_timed(llm, make_prompts(), 1) for _ in range(repeats))
    tn = min(_timed(llm, make_prompts(), output_len) for _ in range(repeats))
    return (tn - t1) / (output_len - 1), t1, tn


def main(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.bench_roofline import (
        ModelShape,
        device_name,
        git_commit,
        measure_copy_bandwidth,
        today,
    )
    from pagedllm.entrypoints.cli_args import engine_args_from
    from pagedllm.entrypoints.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    startup = time.perf_counter() - t0
    runner = llm.llm_engine.engine_core.runner
    vocab = llm.llm_engine.model_config.vocab_size
    rng = random.Random(0)
    shape = ModelShape.from_model(runner.model, llm.llm_engine.model_config.hf_config, runner.dtype.itemsize,
                                  runner.kv_caches[0].element_size() if runner.kv_caches else None)
    on_gpu = runner.device.type == "cuda"
    bandwidth = measure_copy_bandwidth(runner.device) if on_gpu else None
    _timed(llm, [[1] * 16], 4)  # warm-up
    result = {"model": llm.llm_engine.model_config.served_model_name, "device": device_name(runner.device),
              "input_len": ns.input_len, "output_len": ns.output_len, "startup_s": startup,
              "copy_bytes_per_s": bandwidth, "commit": git_commit(), "date": today(), "runs": []}
    for bs in [ns.batch_size, *ns.extra_batch_sizes]:
        def make_prompts(bs=bs):
            return [[rng.randrange(0, min(vocab, 100000)) for _ in range(ns.input_len)] for _ in range(bs)]

        step, t1, tn = decode_step_seconds(llm, make_prompts, ns.output_len, ns.repeats)
        mean_ctx = ns.input_len + ns.output_len / 2
        floor_bytes = shape.num_params * shape.dtype_bytes + bs * mean_ctx * shape.kv_bytes_per_token
        run = {"batch_size": bs, "decode_step_ms": step * 1e3, "prefill_plus_1_s": t1, "total_s": tn}
        if bandwidth:
            run.update(floor_step_ms=floor_bytes / bandwidth * 1e3, step_over_floor=step * bandwidth / floor_bytes)
        result["runs"].append(run)
        floor_txt = f" (floor {run['floor_step_ms']:.3f} ms, {run['step_over_floor']:.2f}x)" if bandwidth else ""
        print(f"batch {bs}: decode step {step * 1e3:.3f} ms{floor_txt}; prefill+1 token {t1:.3f} s")
    if ns.output_json:
        os.makedirs(os.path.dirname(ns.output_json) or ".", exist_ok=True)
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
