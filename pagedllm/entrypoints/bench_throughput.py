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
import random
import time

from pagedllm.sampling_params import SamplingParams


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


def make_workload(kind: str, num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  vocab_limit: int, seed: int) -> Workload:
    if kind == "nano":
        random.seed(0)
        prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
        max_tokens = [random.randint(100, 1024) for _ in range(256)]
        return Workload(prompts, max_tokens)
    rng = random.Random(seed)
    prompts = [[rng.randint(0, vocab_limit - 1) for _ in range(rng.randint(*input_len))] for _ in range(num_requests)]
    max_tokens = [rng.randint(*output_len) for _ in range(num_requests)]
    return Workload(prompts, max_tokens)


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


def run_pagedllm(llm, wl: Workload, temperature: float) -> tuple[float, int]:
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=temperature) for m in wl.max_tokens]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return elapsed, produced


def run_hf_generate(model, wl: Workload, batch_size: int, pad_id: int) -> tuple[float, int]:
    """transformers generate() with left-padded batches sorted by prompt length (greedy)."""
    import torch

    order = sorted(range(len(wl.prompts)), key=lambda i: len(wl.prompts[i]))
    device = next(model.parameters()).device
    counted = 0
    t0 = time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(wl.prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = wl.prompts[i]
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        steps = max(wl.max_tokens[i] for i in idx)
        with torch.inference_mode():
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=steps,
                           min_new_tokens=steps, do_sample=False, pad_token_id=pad_id)
        counted += sum(wl.max_tokens[i] for i in idx)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, counted


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
    from pagedllm.entrypoints.cli import engine_args_from
    from pagedllm.entrypoints.llm import LLM

    args = engine_args_from(ns)
    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(args))
    startup = time.perf_counter() - t0
    cfg = llm.llm_engine.config
    vocab = min(ns.vocab_limit, cfg.model_config.vocab_size)
    wl = make_workload(ns.workload, ns.num_requests, tuple(ns.input_len), tuple(ns.output_len), vocab, ns.bench_seed)
    elapsed, produced = run_pagedllm(llm, wl, ns.temperature)
    result = {
        "workload": ns.workload, "num_requests": len(wl.prompts), "output_tokens": produced,
        "prompt_tokens": sum(map(len, wl.prompts)), "seconds": elapsed,
        "output_tokens_per_s": produced / elapsed, "startup_s": startup, "device": cfg.device,
        "dtype": cfg.model_config.dtype, "model": cfg.model_config.served_model_name,
    }
    print(f"pagedllm: {produced} output tokens in {elapsed:.2f} s = {produced / elapsed:,.1f} tok/s (start-up {startup:.1f} s)")
    if ns.compare_hf:
        hf = load_hf_model(cfg.model_config.source, cfg.model_config.dtype, cfg.device)
        pad = llm.get_tokenizer().pad_token_id or 0
        hf_elapsed, hf_tokens = run_hf_generate(hf, wl, ns.hf_batch_size, pad)
        result.update(hf_generate_seconds=hf_elapsed, hf_generate_tokens_per_s=hf_tokens / hf_elapsed,
                      speedup_vs_hf=(produced / elapsed) / (hf_tokens / hf_elapsed))
        print(f"transformers generate (batches of {ns.hf_batch_size}): {hf_tokens} tokens in {hf_elapsed:.2f} s = "
              f"{hf_tokens / hf_elapsed:,.1f} tok/s")
        print(f"speedup: {result['speedup_vs_hf']:.2f}x")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
