"""Where the multi-LoRA time goes on the GPU (the workload of ``lora_bench.py``: Llama-3.1-8B, 8
random rank-16 adapters on all seven projections, 64 requests of which request ``i`` runs adapter
``i % 8``), on one LoRA engine (``max_loras`` 8). Sections, each printed as it ends (a failing one
does not stop the others):

1. decode: one decode step of 64 tokens: the replay of the plain graph against the graph with the
   delta (8 groups of 8 tokens staged), and the host time of ``stage_graph``;
2. generate: the 64 requests (``--max-tokens``), base requests against mixed (the bench's ratio,
   on one engine);
3. prefill: ``max_tokens`` 1, base requests against mixed;
4. sweep: the launch shapes of the shrink and the expand alone for each layer kind at 64 tokens
   (``kernels.SHRINK_PROGRAMS`` / ``SHRINK_MIN_K_BLOCKS`` / ``EXPAND_BLOCK_N`` / ``SMALL_GROUP_MAX``
   / ``SHRINK_ROW_LOOP_MAX`` / ``EXPAND_ROW_LOOP_MAX`` / warps; CUDA graphs of 50 calls: GPU microseconds per call);
5. ops: each layer kind's whole delta at 64 and at 2048 tokens;
6. kernels: the top kernels of 5 replays of each graph (torch profiler).

Writes JSON (``$OUT/lora_profile.json`` unless ``--output-json``)::

    python benchmarks/gpu/lora_profile.py
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.lora_bench import add_workload_args  # noqa: E402


def cuda_us(fn, n: int = 50) -> float:
    """GPU microseconds per call of ``fn`` (a graph replay or a graph of calls), after a warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def graphed_op_us(fn, calls: int = 50) -> float:
    """GPU microseconds of one call of ``fn`` inside a CUDA graph of ``calls`` calls (no host time)."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_us(graph.replay, 10) / calls


def layer_ops(lora_manager, num_tokens: int, group_size: int) -> dict:
    """Per LoRA layer kind of layer 0: GPU us of its delta (``LoRALinearWeights.apply``) over ``num_tokens`` tokens in groups
    of ``group_size`` (graph replays for decode sizes, eager events otherwise)."""
    import numpy as np
    import torch

    from pagedllm.lora.mapping import build_mapping

    slots = np.repeat(np.arange(num_tokens // group_size) % lora_manager.max_loras, group_size)
    state = lora_manager.state
    state.mapping = build_mapping(slots, lora_manager.device)  # what LoRAModelManager.step sets
    # the shrink workspace where a graph's forward uses it (its zeroing is left out: one launch per forward)
    workspace = getattr(state, "workspace", None)
    state.zeroed_rows = num_tokens if workspace is not None and num_tokens <= workspace.shape[0] else 0
    out = {}
    for name, w in lora_manager.layers.items():
        if ".layers.0." not in f".{name}":
            continue
        k, n = w.lora_a.shape[2], w.lora_b.shape[1]
        x = torch.randn(num_tokens, k, device=lora_manager.device, dtype=w.lora_a.dtype)
        y = torch.randn(num_tokens, n, device=lora_manager.device, dtype=w.lora_a.dtype)
        fn = functools.partial(w.apply, x, y)
        out[name.rsplit(".", 1)[-1]] = graphed_op_us(fn) if num_tokens <= 512 else cuda_us(fn, 10)
    state.mapping, state.zeroed_rows = None, 0
    return out


def generate_times(llm, prompts, loras, max_tokens: int, report: dict) -> None:
    from benchmarks.gpu.lora_bench import timed

    times = {name: timed(llm, prompts, max_tokens, lr) for name, lr in (("base requests", None), ("mixed", loras))}
    report["generate_s"] = times
    print(f"generate {len(prompts)} x {max_tokens} tokens: base requests {times['base requests']:.3f} s, mixed "
          f"{times['mixed']:.3f} s: {times['base requests'] / times['mixed']:.3f}x", flush=True)


def launch_sweep(manager, bs: int, num_adapters: int, report: dict) -> None:
    import torch

    with torch.inference_mode():
        report["launch_sweep_us"] = _launch_sweep(manager, bs, num_adapters)


# (name, kernels module attributes): the shrink's and the expand's launch shapes swept per layer
# kind ("m16": 16-row shrink tiles although the graph's groups may hold up to 64 tokens; "loop":
# one shrink program per group's rows, 16 at a time; "rows16": one expand program per 16 rows
# instead of one looping over a group's 64).
SHRINK_SWEEP = [("64/8", dict(SHRINK_PROGRAMS=64, SHRINK_MIN_K_BLOCKS=8)),
                ("128/2", dict(SHRINK_PROGRAMS=128, SHRINK_MIN_K_BLOCKS=2)),
                ("256/2", dict(SHRINK_PROGRAMS=256, SHRINK_MIN_K_BLOCKS=2)),
                ("512/1", dict(SHRINK_PROGRAMS=512, SHRINK_MIN_K_BLOCKS=1)),
                ("1024/1", dict(SHRINK_PROGRAMS=1024, SHRINK_MIN_K_BLOCKS=1)),
                ("256/2 w8", dict(SHRINK_PROGRAMS=256, SHRINK_MIN_K_BLOCKS=2, SHRINK_WARPS=8)),
                ("512/1 w2", dict(SHRINK_PROGRAMS=512, SHRINK_MIN_K_BLOCKS=1, SHRINK_WARPS=2)),
                ("m16 1024/1", dict(SHRINK_PROGRAMS=1024, SHRINK_MIN_K_BLOCKS=1, SMALL_GROUP_MAX=1 << 20)),
                ("loop 128/2", dict(SHRINK_PROGRAMS=128, SHRINK_MIN_K_BLOCKS=2, SHRINK_ROW_LOOP_MAX=64)),
                ("loop 256/2", dict(SHRINK_PROGRAMS=256, SHRINK_MIN_K_BLOCKS=2, SHRINK_ROW_LOOP_MAX=64))]
EXPAND_SWEEP = [("64", dict(EXPAND_BLOCK_N=64)), ("128", dict(EXPAND_BLOCK_N=128)), ("256", dict(EXPAND_BLOCK_N=256)),
                ("128 w2", dict(EXPAND_BLOCK_N=128, EXPAND_WARPS=2)), ("256 w8", dict(EXPAND_BLOCK_N=256, EXPAND_WARPS=8)),
                ("128 rows16", dict(EXPAND_BLOCK_N=128, EXPAND_ROW_LOOP_MAX=16))]


def _launch_sweep(manager, bs: int, num_adapters: int) -> dict:
    """GPU us of the shrink and the expand alone per layer kind and launch shape (module doc), over
    the decode graph's mapping (``GraphMapping.for_size(bs)``: 8 groups of up to ``bs`` tokens)."""
    import numpy as np
    import torch

    from pagedllm.lora import kernels
    from pagedllm.lora.mapping import GraphMapping

    graph_mapping = GraphMapping(bs, manager.max_loras, manager.device)
    graph_mapping.stage(np.repeat(np.arange(num_adapters), bs // num_adapters))
    mapping = graph_mapping.for_size(bs)
    defaults = {name: getattr(kernels, name) for _, config in SHRINK_SWEEP + EXPAND_SWEEP for name in config}
    rows = {}
    for name, w in manager.layers.items():
        if ".layers.0." not in f".{name}":
            continue
        k, n = w.lora_a.shape[2], w.lora_b.shape[1]
        x = torch.randn(bs, k, device=manager.device, dtype=w.lora_a.dtype)
        y = torch.randn(bs, n, device=manager.device, dtype=w.lora_a.dtype)
        shrunk = torch.zeros(bs, w.width, device=manager.device, dtype=torch.float32)
        calls = [(f"shrink {c}", config, functools.partial(kernels.lora_shrink, x, w.lora_a, mapping, shrunk))
                 for c, config in SHRINK_SWEEP]
        calls += [(f"expand {c}", config, functools.partial(kernels.lora_expand_, y, shrunk, w.lora_b, mapping,
                                                            w.slice_starts, w.max_rank)) for c, config in EXPAND_SWEEP]
        row = {}
        for label, config, fn in calls:
            try:
                for attr, value in config.items():
                    setattr(kernels, attr, value)
                row[label] = round(graphed_op_us(fn), 2)
            except Exception as e:  # one launch shape failing must not lose the others
                row[label] = f"error: {type(e).__name__}: {e}"[:200]
            finally:
                for attr, value in defaults.items():
                    setattr(kernels, attr, value)
        rows[name.rsplit(".", 1)[-1]] = row
        print(f"{name.rsplit('.', 1)[-1]:>12}: " + " | ".join(f"{c} {v}" for c, v in row.items()), flush=True)
    return rows


def prefill_times(llm, prompts, loras, report: dict) -> None:
    from benchmarks.gpu.lora_bench import timed

    prefill = {name: min(timed(llm, prompts, 1, lr) for _ in range(2)) for name, lr in
               (("base requests", None), ("mixed", loras))}
    report["prefill_s"] = prefill
    print(f"prefill of {len(prompts)} prompts (max_tokens 1): base requests {prefill['base requests']:.3f} s, "
          f"mixed {prefill['mixed']:.3f} s", flush=True)


def decode_step(graphs, manager, bs: int, num_adapters: int, report: dict) -> None:
    import numpy as np
    import torch

    token_slots = np.repeat(np.arange(num_adapters), bs // num_adapters)
    with torch.inference_mode():  # the graph mapping's buffer is an inference tensor
        t0 = time.perf_counter()
        for _ in range(20):
            manager.stage_graph(token_slots)
        stage_us = (time.perf_counter() - t0) / 20 * 1e6
        plain_us = cuda_us(lambda: graphs.replay(bs))
        lora_us = cuda_us(lambda: graphs.replay_lora(bs))
    report["decode_step_us"] = {"plain graph": plain_us, "lora graph (8 groups of 8)": lora_us,
                                "stage_graph host": stage_us}
    print(f"decode step of {bs}: plain graph {plain_us:.0f} us, graph with LoRA {lora_us:.0f} us "
          f"({lora_us / plain_us:.3f}x); stage_graph host {stage_us:.0f} us", flush=True)


def op_times(manager, bs: int, num_adapters: int, report: dict) -> None:
    import torch

    with torch.inference_mode():
        report["op_us_decode"] = layer_ops(manager, bs, bs // num_adapters)
        print(f"LoRA delta per layer kind at {bs} tokens (GPU us):",
              {k: round(v, 1) for k, v in report["op_us_decode"].items()}, flush=True)
        report["op_us_prefill_2048"] = layer_ops(manager, 2048, 256)
        print("LoRA delta per layer kind at 2048 tokens (GPU us):",
              {k: round(v, 1) for k, v in report["op_us_prefill_2048"].items()}, flush=True)


def kernel_tables(graphs, bs: int, report: dict) -> None:
    import torch

    for name, fn in (("plain", lambda: graphs.replay(bs)), ("lora", lambda: graphs.replay_lora(bs))):
        with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=70)
        print(f"--- top kernels, 5 replays of the {name} graph ---\n{table}", flush=True)
        report[f"kernels_{name}"] = table


SECTIONS = ("decode", "generate", "prefill", "sweep", "ops", "kernels")  # the order they run in


def main() -> int:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated, of {','.join(SECTIONS)} (module doc)")
    ap.add_argument("--output-json", default=None)
    ns = ap.parse_args()
    unknown = set(ns.sections.split(",")) - set(SECTIONS)
    if unknown:
        ap.error(f"--sections: unknown {sorted(unknown)}")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(ns.prompt_len)] for _ in range(ns.num_requests)]
    report: dict = {"config": vars(ns)}
    try:
        run_sections(ns, prompts, report)
    finally:  # what was measured survives a crash
        path = ns.output_json or os.path.join(os.environ.get("OUT", "."), "lora_profile.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        print("wrote", path)
    return 0


def run_sections(ns, prompts, report: dict) -> None:
    from benchmarks.gpu.lora_bench import timed, write_adapters
    from pagedllm import LLM, LoRARequest

    with tempfile.TemporaryDirectory() as root:
        folders = write_adapters(ns.model, root, ns.num_adapters, ns.rank)
        loras = [LoRARequest(f"adapter{i % ns.num_adapters}", i % ns.num_adapters + 1, folders[i % ns.num_adapters])
                 for i in range(ns.num_requests)]
        llm = LLM(ns.model, load_format="dummy", skip_tokenizer_init=True, max_model_len=ns.prompt_len + ns.max_tokens + 16,
                  max_num_seqs=ns.num_requests, gpu_memory_utilization=0.85, enable_lora=True,
                  max_loras=ns.num_adapters, max_lora_rank=ns.rank)
        timed(llm, prompts, 4, loras)  # every adapter in its slot; kernels compiled
        runner = llm.llm_engine.engine_core.runner
        graphs, manager = runner.graph_runner, runner.lora_manager
        bs = graphs.padded_size(ns.num_requests) if graphs is not None else ns.num_requests
        sections = {"decode": lambda: decode_step(graphs, manager, bs, ns.num_adapters, report),
                    "generate": lambda: generate_times(llm, prompts, loras, ns.max_tokens, report),
                    "prefill": lambda: prefill_times(llm, prompts, loras, report),
                    "sweep": lambda: launch_sweep(manager, bs, ns.num_adapters, report),
                    "ops": lambda: op_times(manager, bs, ns.num_adapters, report),
                    "kernels": lambda: kernel_tables(graphs, bs, report)}
        for name, run in sections.items():
            if name not in ns.sections.split(","):
                continue
            try:
                run()
            except Exception:  # a failed section must not lose the others' numbers
                report[f"{name} error"] = traceback.format_exc()
                print(f"--- {name} failed ---\n{report[f'{name} error']}", flush=True)
        llm.llm_engine.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
