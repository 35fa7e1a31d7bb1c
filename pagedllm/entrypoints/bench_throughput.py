"""Offline throughput: a synthetic workload through LLM.generate, optionally against transformers.

Workloads:
  random  ``--num-requests`` prompts of random token ids, lengths uniform in ``--input-len``
          (min,max), max_tokens uniform in ``--output-len``, ignore_eos (seeded).
  nano    DESIGN.md's nano-bench: random.seed(0), 256 prompts of randint(100,1024) ids in [0,10000],
          then max_tokens randint(100,1024) each (133,966 output tokens), ignore_eos.

``--compare-hf`` runs transformers ``generate()`` on the same requests in the same process: padded
batches of ``--hf-batch-size`` sorted by prompt length, each batch run to its longest max_tokens,
counting only the tokens each request asked for.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from pagedllm.entrypoints import bench_peers
from pagedllm.entrypoints.bench_roofline import git_commit, today
from pagedllm.entrypoints.bench_workload import Workload, make_workload
from pagedllm.sampling_params import SamplingParams


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=["random", "nano"], default="random")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    p.add_argument("--vocab-limit", type=int, default=10000, help="random prompt ids are drawn from [0, this)")
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--compare-hf", action="store_true", help="also time transformers generate() in this process")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--output-json", default=None)
    p.add_argument("--peers", default="", help="comma list of in-process peers on the GPU: hf,hf-cb")
    p.add_argument("--peer-requests", type=int, default=None, help="run the peers on the first N requests only")
    p.add_argument("--peer-batch-size", type=int, default=64, help="padded batch size for the hf generate peer")
    p.add_argument("--trace-steps", default=None, metavar="PATH",
                   help="GPU: write a per-step trace (CUDA events: time, batch shape, context) as JSON")
    p.add_argument("--results-dir", default=None, help="also write <device>-<workload>-bench-<date>.json here")


def run_pagedllm(llm, wl: Workload, temperature: float) -> tuple[float, int]:
    detok = llm.get_tokenizer() is not None
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=temperature, detokenize=detok)
              for m in wl.max_tokens]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return elapsed, produced


def load_hf_model(source, dtype_name: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    if source.kind == "gguf":
        import os

        folder, name = os.path.split(source.path)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    return model.to(device).eval()


def main(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.cli_args import engine_args_from
    from pagedllm.entrypoints.llm import LLM

    args = engine_args_from(ns)
    peers = [p for p in ns.peers.split(",") if p]
    if peers and args.load_format == "dummy":
        # Peers need the very same weights: write one random checkpoint that every engine loads.
        name = os.path.basename(os.path.normpath(args.model or "model"))
        args = args.replace(model=bench_peers.build_random_checkpoint(args.model, f"/tmp/pagedllm-random/{name}"), load_format="auto")
    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(args))
    startup = time.perf_counter() - t0
    cfg = llm.llm_engine.config
    vocab = min(ns.vocab_limit, cfg.model_config.vocab_size)
    wl = make_workload(ns.workload, ns.num_requests, tuple(ns.input_len), tuple(ns.output_len), vocab, ns.bench_seed)
    # Warm-up (as nano-vllm's bench.py): one short request, not timed.
    run_pagedllm(llm, Workload([wl.prompts[0][:8]], [16]), ns.temperature)
    core = llm.llm_engine.engine_core
    core.step_timings.update(schedule=0.0, execute=0.0, update=0.0, steps=0)
    core.runner.timings["prepare"] = 0.0
    if ns.trace_steps:
        from pagedllm.worker.model_runner import StepTrace

        core.runner.trace = StepTrace()
    elapsed, produced = run_pagedllm(llm, wl, ns.temperature)
    if ns.trace_steps:
        _write_trace(core.runner, ns.trace_steps)
    phases = {k: round(v, 3) for k, v in {**core.step_timings, **core.runner.timings}.items()}
    result = {
        "workload": ns.workload, "num_requests": len(wl.prompts), "output_tokens": produced,
        "prompt_tokens": sum(map(len, wl.prompts)), "seconds": elapsed,
        "output_tokens_per_s": produced / elapsed, "startup_s": startup, "device": cfg.device,
        "dtype": cfg.model_config.dtype, "model": cfg.model_config.served_model_name,
        "temperature": ns.temperature, "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "enforce_eager": cfg.enforce_eager, "commit": git_commit(), "date": today(), "phase_seconds": phases,
    }
    print(f"pagedllm: {produced} output tokens in {elapsed:.2f} s = {produced / elapsed:,.1f} tok/s (start-up {startup:.1f} s)")
    print(f"phases (s): {phases}")
    if cfg.device.startswith("cuda"):
        _gpu_floor(llm, wl, result)
    if ns.compare_hf:
        hf = load_hf_model(cfg.model_config.source, cfg.model_config.dtype, cfg.device)
        pad = llm.get_tokenizer().pad_token_id or 0
        hf_elapsed, hf_tokens = bench_peers.generate_padded(hf, wl, ns.hf_batch_size, pad)
        result.update(hf_generate_seconds=hf_elapsed, hf_generate_tokens_per_s=hf_tokens / hf_elapsed,
                      speedup_vs_hf=(produced / elapsed) / (hf_tokens / hf_elapsed))
        print(f"transformers generate (batches of {ns.hf_batch_size}): {hf_tokens} tokens in {hf_elapsed:.2f} s = "
              f"{hf_tokens / hf_elapsed:,.1f} tok/s")
        print(f"speedup: {result['speedup_vs_hf']:.2f}x")
    if peers:
        folder = cfg.model_config.source.path
        # Every reference to the engine goes (``core`` holds the runner, its KV cache and graphs), so
        # the peers get the GPU memory back: on an 80 GB H100 the KV cache left them too little.
        del llm, core
        _run_peers(peers, folder, wl, ns, result)
    _write_results(result, ns)
    return 0


def _write_trace(runner, path: str) -> None:
    rows = runner.trace.rows()
    runner.trace = None
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f)
    gpu = sum(r["gpu_ms"] for r in rows) / 1e3
    idle = sum(r.get("idle_after_ms", 0.0) for r in rows) / 1e3
    print(f"trace: {len(rows)} steps, GPU busy {gpu:.2f} s, idle between steps {idle:.2f} s -> {path}")


def _gpu_floor(llm, wl: Workload, result: dict) -> None:
    from pagedllm.entrypoints.bench_roofline import (
        ModelShape,
        device_name,
        generation_floor,
        measure_copy_bandwidth,
        measure_matmul_rate,
    )

    runner = llm.llm_engine.engine_core.runner
    shape = ModelShape.from_model(runner.model, llm.llm_engine.model_config.hf_config, runner.dtype.itemsize,
                                  runner.kv_caches[0].element_size() if runner.kv_caches else None)
    floor = generation_floor(shape, [len(p) for p in wl.prompts], wl.max_tokens,
                             measure_copy_bandwidth(runner.device), measure_matmul_rate(runner.device))
    result.update(device=device_name(runner.device), floor=floor.as_dict(), floor_seconds=floor.seconds,
                  fraction_of_floor=floor.seconds / result["seconds"],
                  floor_output_tokens_per_s=result["output_tokens"] / floor.seconds)
    print(f"floor: {floor.bytes_moved / 1e12:.2f} TB at {floor.copy_bytes_per_s / 1e12:.2f} TB/s = {floor.bytes_seconds:.2f} s; "
          f"{floor.flops / 1e15:.2f} PFLOP at {floor.matmul_flops_per_s / 1e12:.0f} TFLOP/s = {floor.flops_seconds:.2f} s; "
          f"we reach {result['fraction_of_floor']:.0%} of the floor")


def _run_peers(peers: list[str], folder: str, wl: Workload, ns, result: dict) -> None:
    import gc

    import torch


    gc.collect()
    torch.cuda.empty_cache()
    print(f"peers: the engine is released; {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated")
    n = ns.peer_requests or len(wl.prompts)
    prompts, max_tokens = wl.prompts[:n], wl.max_tokens[:n]
    result["peers"] = []
    for peer in peers:
        if peer == "hf":
            r = bench_peers.run_hf_generate(folder, prompts, max_tokens, ns.peer_batch_size)
        elif peer == "hf-cb":
            r = bench_peers.run_hf_generate_batch(folder, prompts, max_tokens)
        else:
            raise ValueError(f"--peers: unknown peer {peer!r} (known: hf, hf-cb)")
        r["speedup_of_pagedllm"] = result["output_tokens_per_s"] / r["output_tokens_per_s"]
        result["peers"].append(r)
        key = {"hf": "speedup_vs_hf", "hf-cb": "speedup_vs_hf_cb"}[peer]
        result[key] = r["speedup_of_pagedllm"]
        print(f"{r['peer']}: {r['output_tokens']} tokens in {r['seconds']:.1f} s = {r['output_tokens_per_s']:,.0f} tok/s "
              f"({r['requests']} requests) -> pagedllm is {r['speedup_of_pagedllm']:.1f}x")


def _write_results(result: dict, ns) -> None:
    paths = [ns.output_json] if ns.output_json else []
    if ns.results_dir:
        dev = result["device"].lower().replace("nvidia ", "").replace(" ", "-")
        paths.append(os.path.join(ns.results_dir, f"{dev}-{ns.workload}-bench-{result['date']}.json"))
    for path in paths:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")
