"""Speculative decoding on the GPU: n-gram on a copy workload, and a model as its own draft.

1. N-gram, batch 1, real weights (the embedded SmolLM2 unless ``--ngram-model``): the prompt is a
   ~1,000-token passage of random common words followed by its first 32 tokens again, so greedy
   decoding copies the passage; time per output token without speculation and with
   ``{"method": "ngram", "num_speculative_tokens": k}``, and whether the outputs are the same.
2. Draft model = target (Qwen3-0.6B architecture, random bf16 weights, same seed: every greedy
   draft is accepted, so this measures the mechanism's cost): output tokens/s at batch 1 and 16,
   k = 3 against no speculation, and the overhead of propose + verify per step.

The n-gram part runs once per ``--ngram-paths`` entry (``default``: on CUDA the GGUF blocks are
dequantized into the model dtype at load; ``packed``: ``quantization="gguf"``, the Triton GGUF
kernels; ``gguf_dequantized``: float weights loaded) and reports the time of one replay of the
batch-1 decode and verify graphs. Prints a table and writes JSON to
``--output-json``:

    python benchmarks/gpu/spec_decode_bench.py --output-json $OUT/spec_decode.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

WORDS = ("the of and to in is was for on that with as by at from his her they this which or had are not "
         "but were be one all their there been has when who will more no if out so said what up its about "
         "into than them can only other new some could time these two may then do first any my now such like "
         "our over man me even most made after also did many before must through back years where much your "
         "way well down should because each just those people how too little state good very make world still "
         "own see men work long get here between both life being under never day same another know while last "
         "might us great old year off come since against go came right used take three").split()


def copy_prompt(tokenizer, num_words: int = 700, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    passage = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(num_words)))
    return passage + tokenizer.encode("\n\n") + passage[:32]


def timed(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]], dict]:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    stats = llm.llm_engine.engine_core.scheduler.stats().spec_decoding
    spec = {} if stats is None else {"num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
                                     "num_accepted_tokens": stats.num_accepted_tokens,
                                     "mean_acceptance_length": stats.mean_acceptance_length}
    return elapsed, [list(o.outputs[0].token_ids) for o in outs], spec


def count_replays(graphs) -> dict:
    """Wrap ``graphs.replay`` (a CUDAGraphRunner, or None) to count replays per queries per request."""
    counts: dict = {}
    if graphs is None:
        return counts
    replay = graphs.replay

    def counting(bs: int, q: int = 1):
        counts[f"q={q}"] = counts.get(f"q={q}", 0) + 1
        return replay(bs, q)

    graphs.replay = counting
    return counts


def release(llm) -> None:
    import torch

    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def replay_ms(graphs, shape: tuple[int, int], n: int = 50) -> float:
    """CUDA-event time of one replay of the graph of ``shape`` (after the runs: it rewrites the
    last step's KV slots)."""
    import torch

    graphs.replay(*shape)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graphs.replay(*shape)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


# The GGUF serving paths the n-gram part can run: the default (on CUDA the blocks are dequantized into
# the model dtype at load), the Triton GGUF kernels (quantization="gguf" given), float weights loaded.
NGRAM_PATHS = {"default": {}, "packed": {"quantization": "gguf"}, "gguf_dequantized": {"load_format": "gguf_dequantized"}}


def ngram_part(ns, path: str) -> dict:
    from pagedllm import LLM

    results = {}
    for name, spec in (("off", None), ("ngram", {"method": "ngram", "num_speculative_tokens": ns.ngram_k,
                                                  "prompt_lookup_min": 2, "prompt_lookup_max": 4})):
        llm = LLM(ns.ngram_model, max_model_len=2048, max_num_seqs=16, gpu_memory_utilization=0.4,
                  speculative_config=spec, **NGRAM_PATHS[path])
        prompt = copy_prompt(llm.get_tokenizer())
        timed(llm, [prompt], 16)  # warm-up
        graphs = llm.llm_engine.engine_core.runner.graph_runner
        replays = count_replays(graphs)
        elapsed, outs, stats = timed(llm, [prompt], ns.max_tokens)
        results[name] = {"ms_per_token": 1e3 * elapsed / ns.max_tokens, "tokens": outs[0], "prompt_len": len(prompt),
                         "graph_replays": replays, **stats}
        if graphs is not None:
            del graphs.replay  # unwrap
            results[name]["graph_replay_ms"] = {f"q={q}": replay_ms(graphs, (1, q)) for bs, q in graphs.graphs
                                                if bs == 1}
        release(llm)
    results["same_output"] = results["off"]["tokens"] == results["ngram"]["tokens"]
    results["speedup"] = results["off"]["ms_per_token"] / results["ngram"]["ms_per_token"]
    for name in ("off", "ngram"):
        del results[name]["tokens"]
    return results


def draft_part(ns) -> dict:
    from pagedllm import LLM

    rng = random.Random(0)
    prompts = [[rng.randrange(10000) for _ in range(256)] for _ in range(max(ns.batch_sizes))]
    results = {}
    for k in (0, ns.draft_k):
        spec = {"method": "draft_model", "model": ns.draft_model, "num_speculative_tokens": k} if k else None
        llm = LLM(ns.draft_model, load_format="dummy", skip_tokenizer_init=True, max_model_len=1024,
                  max_num_seqs=max(ns.batch_sizes), gpu_memory_utilization=0.4, speculative_config=spec)
        timed(llm, prompts[:2], 16)  # warm-up
        runner = llm.llm_engine.engine_core.runner
        for batch in ns.batch_sizes:
            replays = count_replays(runner.graph_runner)
            draft = getattr(runner.proposer, "runner", None)
            draft_replays = count_replays(draft.graphs if draft is not None else None)
            elapsed, outs, stats = timed(llm, prompts[:batch], ns.max_tokens)
            results[f"k={k} batch={batch}"] = {"tokens_per_s": batch * ns.max_tokens / elapsed,
                                               "ms_per_step": 1e3 * elapsed / ns.max_tokens, "graph_replays": replays,
                                               "draft_graph_replays": draft_replays, **stats}
            if runner.graph_runner is not None:  # unwrap for the next batch size
                del runner.graph_runner.replay
            if draft is not None and draft.graphs is not None:
                del draft.graphs.replay
        release(llm)
    for batch in ns.batch_sizes:
        plain, spec = results[f"k=0 batch={batch}"], results[f"k={ns.draft_k} batch={batch}"]
        # A verifying step gives each request k + 1 tokens (all accepted): its cost over k + 1 plain steps.
        steps = ns.max_tokens / spec["mean_acceptance_length"]
        spec["overhead_per_step_ms"] = (1e3 * ns.max_tokens / spec["tokens_per_s"] * batch / steps
                                        - plain["ms_per_step"])
    return results


def print_ngram(ng: dict, path: str, k: int) -> None:
    if "error" in ng:
        print(f"n-gram ({path}): failed: {ng['error']}")
        return
    print(f"n-gram batch 1 ({path}): {ng['off']['ms_per_token']:.2f} ms/token off, "
          f"{ng['ngram']['ms_per_token']:.2f} with k={k} (x{ng['speedup']:.2f}, mean acceptance length "
          f"{ng['ngram'].get('mean_acceptance_length', 1.0):.2f}, same output: {ng['same_output']})")
    print(f"  graph replays: off {ng['off']['graph_replays']}, n-gram {ng['ngram']['graph_replays']}; one replay (ms): "
          f"{ng['ngram'].get('graph_replay_ms')}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ngram-model", default=None, help="default: the embedded SmolLM2 (real weights)")
    ap.add_argument("--ngram-paths", nargs="+", choices=sorted(NGRAM_PATHS), default=["default"],
                    help="default (GGUF dequantized into the model dtype on CUDA), packed (the Triton GGUF "
                         "kernels), gguf_dequantized (float weights)")
    ap.add_argument("--draft-model", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--parts", nargs="+", choices=["ngram", "draft"], default=["ngram", "draft"])
    ap.add_argument("--ngram-k", type=int, default=5)
    ap.add_argument("--draft-k", type=int, default=3)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--output-json", default=None)
    ns = ap.parse_args()
    report: dict = {"ngram": {}}
    for path in ns.ngram_paths if "ngram" in ns.parts else ():
        try:
            report["ngram"][path] = ngram_part(ns, path)
        except Exception as e:  # noqa: BLE001 - one failing configuration must not lose the others
            report["ngram"][path] = {"error": repr(e)}
        print_ngram(report["ngram"][path], path, ns.ngram_k)
    if "draft" in ns.parts:
        report["draft_model"] = draft_part(ns)
        print(f"{'draft = target':<20} {'tok/s':>10} {'accept len':>11} {'overhead ms/step':>16}  graph replays (draft)")
        for name, row in report["draft_model"].items():
            print(f"{name:<20} {row['tokens_per_s']:>10.1f} {row.get('mean_acceptance_length', 1.0):>11.2f} "
                  f"{row.get('overhead_per_step_ms', 0.0):>16.2f}  {row['graph_replays']} ({row['draft_graph_replays']})")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
