"""CPU cost of sampling features: a batch with penalties + logprobs vs a plain greedy batch.

Two measurements, each as a ratio taken within one run (interleaved repeats, best of N):
1. end to end: the embedded SmolLM2-135M (float32, CPU) decodes a batch of B requests
   (``--prompt-len`` random prompt tokens, ``--max-tokens`` outputs, ignore_eos), once plain greedy and
   once greedy with repetition/presence/frequency penalties and logprobs=5 (plus a mixed batch:
   seeded top-p/top-k/min-p sampling with penalties and logprobs);
2. the sampler alone on [B, V] logits with the same parameters and token history (metadata build
   included), to show what the sampling features themselves cost.

    python benchmarks/sampling_cost.py --batch 32 --max-tokens 32 --repeats 3 [--threads 1]

On a small shared machine, ``--threads 1`` gives far steadier figures (multi-threaded kernels on
contended cores pay large synchronisation stalls that swamp the work being compared).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sample.history import TokenHistory
from pagedllm.sample.sampler import Sampler, build_sampling_metadata

PENALTIES = dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5)


def variants(max_tokens: int) -> dict[str, list[SamplingParams] | SamplingParams]:
    common = dict(max_tokens=max_tokens, ignore_eos=True)
    return {
        "greedy": SamplingParams(temperature=0.0, **common),
        "greedy+penalties+logprobs": SamplingParams(temperature=0.0, logprobs=5, **PENALTIES, **common),
        "mixed+penalties+logprobs": SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.02, seed=1,
                                                   logprobs=5, **PENALTIES, **common),
    }


def run_engine(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Seconds to generate every request of the batch (prefill + decode)."""
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.perf_counter_ns()}-{i}", {"prompt_token_ids": p}, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def sampler_seconds(params: SamplingParams, batch: int, vocab: int, prompt_len: int, out_len: int, iters: int) -> float:
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
    outputs = [[rng.randrange(vocab) for _ in range(out_len)] for _ in range(batch)]
    history = TokenHistory.from_lists(prompts, outputs)
    logits = torch.randn(batch, vocab)
    sampler = Sampler()
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        meta = build_sampling_metadata([params] * batch, history, torch.device("cpu"), vocab)
        sampler(logits.clone(), meta).token_ids.tolist()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine.from_engine_args(EngineArgs(dtype="float32", enable_prefix_caching=False))
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    cases = variants(args.max_tokens)
    run_engine(engine, prompts[:4], cases["greedy"])  # warm-up
    e2e = {name: float("inf") for name in cases}
    for _ in range(args.repeats):  # interleaved, best of N: the machine is shared and noisy
        for name, params in cases.items():
            e2e[name] = min(e2e[name], run_engine(engine, prompts, params))
    sampler = {name: sampler_seconds(p, args.batch, vocab, args.prompt_len, args.max_tokens // 2, 20)
               for name, p in cases.items()}
    result = {
        "model": "SmolLM2-135M (embedded GGUF), float32, CPU", "threads": torch.get_num_threads(),
        "batch": args.batch, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "end_to_end_s": e2e, "end_to_end_ratio_vs_greedy": {n: e2e[n] / e2e["greedy"] for n in cases},
        "sampler_ms": {n: 1e3 * s for n, s in sampler.items()},
        "sampler_ratio_vs_greedy": {n: sampler[n] / sampler["greedy"] for n in cases},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    with torch.inference_mode():  # as the engine runs its steps; keeps no autograd state either way
        main()
