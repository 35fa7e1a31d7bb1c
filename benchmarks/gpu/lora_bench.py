"""Multi-LoRA throughput on the GPU: 8 adapters of rank 16 mixed across 64 requests, against the
base model alone (Llama-3.1-8B architecture, random bf16 weights; the issue's target: >= 0.8x).

The adapters are random PEFT folders (all seven projections, rank 16, ``lora_alpha`` 32) written
to a temporary directory. Three runs of the same 64 requests (``--prompt-len`` random tokens,
``--max-tokens`` generated, ``ignore_eos``):

- ``base``: an engine without LoRA;
- ``lora engine, base requests``: ``enable_lora`` but no adapter in the batch (the plain path);
- ``8 adapters mixed``: request ``i`` runs adapter ``i % 8`` (``max_loras`` 8).

Prints a table and writes JSON (``$OUT/lora_bench.json`` unless ``--output-json``):

    python benchmarks/gpu/lora_bench.py
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time


def write_adapters(config_dir: str, root: str, num: int, rank: int, seed: int = 0) -> list[str]:
    """``num`` random PEFT LoRA folders for the model of ``config_dir`` (bf16 safetensors)."""
    import torch
    from safetensors.torch import save_file

    from pagedllm.loader import load_hf_config, resolve_model
    from pagedllm.lora.peft_config import SUPPORTED_TARGETS, model_shapes

    hf_config = load_hf_config(resolve_model(config_dir))
    shapes = model_shapes(hf_config)
    gen = torch.Generator().manual_seed(seed)
    folders = []
    for a in range(num):
        tensors = {}
        for layer in range(hf_config.num_hidden_layers):
            for target in SUPPORTED_TARGETS:
                out_features, in_features = shapes[target]
                group = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                name = f"base_model.model.model.layers.{layer}.{group}.{target}"
                tensors[f"{name}.lora_A.weight"] = (torch.randn(rank, in_features, generator=gen)
                                                    / in_features**0.5).bfloat16()
                tensors[f"{name}.lora_B.weight"] = (torch.randn(out_features, rank, generator=gen) * 0.01).bfloat16()
        folder = os.path.join(root, f"adapter{a}")
        os.makedirs(folder)
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(SUPPORTED_TARGETS),
                       "bias": "none"}, f)
        folders.append(folder)
    return folders


def timed(llm, prompts: list[list[int]], max_tokens: int, loras) -> float:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return elapsed


def run_engine(ns, prompts, enable_lora: bool, workloads: dict) -> dict:
    import torch

    from pagedllm import LLM

    kwargs = dict(enable_lora=True, max_loras=ns.num_adapters, max_lora_rank=ns.rank) if enable_lora else {}
    llm = LLM(ns.model, load_format="dummy", skip_tokenizer_init=True, max_model_len=ns.prompt_len + ns.max_tokens + 16,
              max_num_seqs=len(prompts), gpu_memory_utilization=ns.gpu_memory_utilization, **kwargs)
    graph_runner = llm.llm_engine.engine_core.runner.graph_runner
    results = {"lora_graph_sizes": len(graph_runner.lora_graphs) if graph_runner is not None else 0}
    for name, loras in workloads.items():
        timed(llm, prompts[:8], 16, loras[:8] if isinstance(loras, list) else loras)  # warm-up (adapters load)
        elapsed = min(timed(llm, prompts, ns.max_tokens, loras) for _ in range(ns.repeats))
        results[name] = {"seconds": elapsed, "output_tokens_per_s": len(prompts) * ns.max_tokens / elapsed}
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return results


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload's flags (model, requests, adapters, rank, lengths), shared with lora_profile.py."""
    ap.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--num-adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)


def main() -> int:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--output-json", default=None)
    ns = ap.parse_args()
    from pagedllm import LoRARequest

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(ns.prompt_len)] for _ in range(ns.num_requests)]
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        folders = write_adapters(ns.model, root, ns.num_adapters, ns.rank)
        print(f"wrote {ns.num_adapters} adapters of rank {ns.rank} in {time.perf_counter() - t0:.1f} s")
        loras = [LoRARequest(f"adapter{i % ns.num_adapters}", i % ns.num_adapters + 1, folders[i % ns.num_adapters])
                 for i in range(ns.num_requests)]
        report = {"config": vars(ns)}
        report["base"] = run_engine(ns, prompts, False, {"base": None})["base"]
        print("base engine done")
        lora = run_engine(ns, prompts, True, {"lora engine, base requests": None, "8 adapters mixed": loras})
        report["lora_graph_sizes"] = lora.pop("lora_graph_sizes")
        report.update(lora)
    base_tps = report["base"]["output_tokens_per_s"]
    print(f"{'run':<28} {'seconds':>8} {'out tok/s':>10} {'x base':>7}")
    for name in ("base", "lora engine, base requests", "8 adapters mixed"):
        row = report[name]
        row["ratio_to_base"] = row["output_tokens_per_s"] / base_tps
        print(f"{name:<28} {row['seconds']:>8.2f} {row['output_tokens_per_s']:>10.1f} {row['ratio_to_base']:>7.3f}")
    report["target_met"] = report["8 adapters mixed"]["ratio_to_base"] >= 0.8
    print(f"target (8 adapters >= 0.8x base): {'met' if report['target_met'] else 'NOT met'}; "
          f"decode graphs with LoRA: {report['lora_graph_sizes']} sizes")
    path = ns.output_json or os.path.join(os.environ.get("OUT", "."), "lora_bench.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
