"""Mixture-of-experts decode on the Qwen3-30B-A3B architecture (random bf16 weights), one script.

Two parts, each in its own process (one 61 GB model in GPU memory at a time):

1. engine: the decode step (``bench latency``'s measure: (time for N tokens - time for 1) / (N - 1),
   best of 2) at batch 64 (and 1) with 1024-token prompts, against its floor: the weights a step
   must read (everything but the embedding table and the experts, plus the *active* experts of
   every layer) and the KV cache at the mean context, over the measured copy bandwidth. The active
   experts per layer are counted from the router's choices (hooks on the router during the eager
   prefill steps, averaged over random sets of ``batch`` rows). Then one layer's MoE block
   (router + fused experts) is timed alone at the batch size, replayed from a CUDA graph, against
   its own floor (its active experts' bytes), and times the number of MoE layers it gives the MoE
   share of the step.
2. throughput: the nano-bench workload (``pagedllm bench throughput --workload nano``: 256 requests,
   100-1024 prompt and output tokens) on the same architecture; its printed floor counts every
   expert (an upper bound of the bytes and the FLOPs of an MoE model).

Prints a table and writes ``$OUT/moe-qwen3-30b-a3b.json`` (one part: ``...-engine.json`` /
``...-throughput.json``; ``--out`` to change). From the repo root:

    python benchmarks/gpu/moe_bench.py                      # both parts: about 10 minutes on an H200
    python benchmarks/gpu/moe_bench.py --part engine        # one part (each a few minutes)
    python benchmarks/gpu/moe_bench.py --part throughput

(an 80 GB H100 holds the 61 GB of weights with little room for the KV cache: use an H200).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.int4_decode_bench import graph_time_us  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "benchmarks/configs/qwen3-30b-a3b"


class RouterLog:
    """The top-k expert ids the routers chose on eager forwards (prefill steps; graphed decode steps
    run no Python), up to ``max_rows`` rows per layer."""

    def __init__(self, blocks: list, top_k: int, max_rows: int = 4096) -> None:
        self.ids: list[list] = [[] for _ in blocks]
        self.top_k, self.max_rows = top_k, max_rows
        self.handles = [b.gate.register_forward_hook(self._hook(i)) for i, b in enumerate(blocks)]

    def _hook(self, layer: int):
        def hook(module, inputs, logits):
            if sum(len(x) for x in self.ids[layer]) < self.max_rows:
                self.ids[layer].append(logits.topk(self.top_k, dim=-1).indices.cpu())
        return hook

    def mean_active(self, batch: int, samples: int = 20) -> float:
        """Mean number of distinct experts among ``batch`` random rows, over layers and samples."""
        import torch

        gen = torch.Generator().manual_seed(0)
        counts = []
        for chunks in self.ids:
            rows = torch.cat(chunks)
            for _ in range(samples):
                pick = torch.randperm(rows.shape[0], generator=gen)[:batch]
                counts.append(rows[pick].unique().numel())
        return sum(counts) / len(counts)


def engine_part(batch_sizes: list[int], input_len: int, output_len: int) -> dict:
    import random

    from pagedllm import LLM
    from pagedllm.entrypoints.bench_latency import decode_step_seconds
    from pagedllm.entrypoints.bench_roofline import device_name, measure_copy_bandwidth
    from pagedllm.layers.fused_moe import FusedMoE
    from pagedllm.models.moe import SparseMoeBlock

    config = json.loads((MODEL / "config.json").read_text())
    llm = LLM(str(MODEL), load_format="dummy", skip_tokenizer_init=True, max_model_len=input_len + output_len + 64)
    runner = llm.llm_engine.engine_core.runner
    model = runner.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    nbytes = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    expert_params = [p for m in experts for p in (m.w13_weight, m.w2_weight)]
    embed = model.model.embed_tokens.weight
    dense_bytes = nbytes(model.parameters()) - nbytes(expert_params) - nbytes([embed])
    per_expert = (experts[0].w13_weight[0].numel() + experts[0].w2_weight[0].numel()) * embed.element_size()
    kv_per_token = (2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"]
                    * runner.kv_caches[0].element_size())
    bandwidth = measure_copy_bandwidth(runner.device)
    log = RouterLog(blocks, config["num_experts_per_tok"])
    rng = random.Random(0)
    runs = []
    for bs in batch_sizes:
        def prompts(bs=bs):
            return [[rng.randrange(0, 100000) for _ in range(input_len)] for _ in range(bs)]

        step, _, _ = decode_step_seconds(llm, prompts, output_len, repeats=2)
        active = log.mean_active(bs)
        kv_bytes = bs * (input_len + output_len / 2) * kv_per_token
        floor = (dense_bytes + len(experts) * active * per_expert + kv_bytes) / bandwidth
        moe_us = moe_block_us(blocks[0], bs, config["hidden_size"])
        moe_floor_us = active * per_expert / bandwidth * 1e6
        runs.append({"batch": bs, "step_ms": step * 1e3, "floor_ms": floor * 1e3, "fraction_of_floor": floor / step,
                     "active_experts_per_layer": active, "moe_block_us": moe_us, "moe_block_floor_us": moe_floor_us,
                     "moe_share_of_step": len(experts) * moe_us * 1e-6 / step,
                     "moe_fraction_of_floor": moe_floor_us / moe_us, "kv_gb": kv_bytes / 1e9})
    for h in log.handles:
        h.remove()
    return {"device": device_name(runner.device), "copy_gb_per_s": bandwidth / 1e9, "dense_gb": dense_bytes / 1e9,
            "expert_mb": per_expert / 1e6, "moe_layers": len(experts), "input_len": input_len,
            "output_len": output_len, "runs": runs}


def moe_block_us(block, batch: int, hidden: int) -> float:
    """One MoE block (router GEMM + fused experts) at ``batch`` rows of random post-norm activations."""
    import torch

    x = torch.randn(batch, hidden, device="cuda", dtype=block.gate.weight.dtype)
    with torch.inference_mode():
        return graph_time_us(lambda: block.experts(x, block.gate(x)), calls=10)


def throughput_part(out_json: str) -> dict:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "throughput", "--workload", "nano",
           "--model", str(MODEL), "--load-format", "dummy", "--skip-tokenizer-init", "--max-model-len", "4096",
           "--temperature", "0.6", "--output-json", out_json]
    subprocess.run(cmd, check=True, cwd=ROOT)
    result = json.loads(Path(out_json).read_text())
    keys = ("requests", "output_tokens", "seconds", "output_tokens_per_s", "device")
    return {k: result[k] for k in keys if k in result}


def run_part(part: str, ns: argparse.Namespace) -> dict:
    """``part`` in a fresh process (its own GPU memory); returns its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"{part}.json")
        cmd = [sys.executable, __file__, "--part", part, "--part-out", out, "--input-len", str(ns.input_len),
               "--output-len", str(ns.output_len), "--batch-sizes", *map(str, ns.batch_sizes)]
        subprocess.run(cmd, check=True, cwd=ROOT)
        return json.loads(Path(out).read_text())


def print_table(result: dict) -> None:
    engine = result.get("engine")
    if engine:
        print_engine_table(engine)
    tp = result.get("throughput")
    if tp:
        print(f"nano-bench: {tp['output_tokens']} tokens in {tp['seconds']:.1f} s = {tp['output_tokens_per_s']:,.0f} tok/s")


def print_engine_table(engine: dict) -> None:
    print(f"\n{engine['device']}: copy {engine['copy_gb_per_s']:.0f} GB/s; dense weights {engine['dense_gb']:.2f} GB; "
          f"one expert {engine['expert_mb']:.2f} MB x {engine['moe_layers']} MoE layers")
    print(f"{'batch':>5} {'step ms':>8} {'floor ms':>8} {'of floor':>8} {'experts':>7} {'moe us':>7} "
          f"{'moe floor':>9} {'moe share':>9}")
    for r in engine["runs"]:
        print(f"{r['batch']:>5} {r['step_ms']:>8.2f} {r['floor_ms']:>8.2f} {r['fraction_of_floor']:>8.0%} "
              f"{r['active_experts_per_layer']:>7.1f} {r['moe_block_us']:>7.0f} {r['moe_block_floor_us']:>9.0f} "
              f"{r['moe_share_of_step']:>9.0%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["all", "engine", "throughput"], default="all")
    p.add_argument("--part-out", help=argparse.SUPPRESS)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 1])
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", default=None, help="default: $OUT/moe-qwen3-30b-a3b[-PART].json")
    ns = p.parse_args()
    suffix = "" if ns.part == "all" else f"-{ns.part}"
    ns.out = ns.out or os.path.join(os.environ.get("OUT", "benchmarks/results"), f"moe-qwen3-30b-a3b{suffix}.json")
    if ns.part_out:  # one part, for ``run_part``
        out = (engine_part(ns.batch_sizes, ns.input_len, ns.output_len) if ns.part == "engine"
               else throughput_part(ns.part_out + ".bench.json"))
        Path(ns.part_out).write_text(json.dumps(out))
        return
    parts = ["engine", "throughput"] if ns.part == "all" else [ns.part]
    result = {"model": "qwen3-30b-a3b (random bf16)", **{part: run_part(part, ns) for part in parts}}
    print_table(result)
    os.makedirs(os.path.dirname(ns.out) or ".", exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
