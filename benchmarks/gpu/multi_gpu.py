"""Tensor / pipeline parallel on several GPUs of one host: correctness against one GPU, scaling, a
model too big for one GPU. Each phase runs in its own process under a time limit (a hung NCCL
collective costs that phase, not the run) and appends its figures to ``$OUT/multi_gpu.json``.

Phases (run in the order given):
  allreduce            all-reduce latency of one decode step's activation ([bs, hidden] bf16, the
                       size a row-parallel projection reduces): NCCL against the symmetric-memory
                       one-shot kernel (pagedllm/distributed/symm_all_reduce.py), eager
  correct:MODEL        a random bf16 checkpoint of MODEL (a benchmarks/configs folder) written once,
                       then TP=1, TP=2 and PP=2 on the same weights: teacher-forced prompt logprobs
                       of a ragged batch against TP=1, and greedy agreement over 32 tokens
  scale:MODEL:TP:PP[:MB]  random weights (load_format dummy): the nano-bench workload's output tokens/s
                       and the batch-1 decode step (1024 in), against the weight-bytes floor per GPU;
                       with PP > 1, MB micro-batches in flight (default PP: the engine's batch queue;
                       1: one batch at a time, the stages taking turns)
  decode:MODEL:TP:PP   decode step at batch 1 and 64 only (for models that do not fit one GPU)

Usage (repo root, GPU machine): python benchmarks/gpu/multi_gpu.py allreduce correct:qwen3-0.6b \
    scale:llama-3.1-8b:1:1 scale:llama-3.1-8b:2:1 [--phase-timeout 300]
Prints a table at the end; each phase's record has device, date and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
RESULTS = os.path.join(os.environ.get("OUT", "benchmarks/results"), "multi_gpu.json")
CKPT_ROOT = "/tmp/pagedllm-ckpt"


def _record(entry: dict) -> None:
    from pagedllm.entrypoints.bench_roofline import git_commit, today

    entry.update(date=today(), commit=git_commit())
    data = json.load(open(RESULTS)) if os.path.exists(RESULTS) else []
    data.append(entry)
    os.makedirs(os.path.dirname(RESULTS) or ".", exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(data, f, indent=2)
    print("RESULT", json.dumps(entry), flush=True)


def _config_dir(model: str) -> str:
    """A benchmarks/configs folder by name, or any folder with a config.json."""
    return model if os.path.isdir(model) else os.path.join(CONFIGS, model)


def _config(model: str) -> dict:
    return json.load(open(os.path.join(_config_dir(model), "config.json")))


def weight_bytes(cfg: dict, dtype_bytes: int = 2) -> int:
    """Bytes of every weight of a Llama/Qwen-shaped model (the decode floor reads them once)."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    embed = cfg["vocab_size"] * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return (layers * per_layer + embed) * dtype_bytes


def _copy_bandwidth() -> float:
    import torch

    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    rate = 2 * 2**30 * 20 / (time.perf_counter() - t0)
    del x, y
    torch.cuda.empty_cache()
    return rate


# -- all-reduce -----------------------------------------------------------------------------------
def _allreduce_rank(rank: int, world: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from pagedllm.distributed.symm_all_reduce import SymmMemAllReduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    group = dist.new_group(list(range(world)))
    symm = SymmMemAllReduce(group, torch.device("cuda", rank), 2 * 2**20, torch.bfloat16)

    def time_us(fn, x, n=200) -> float:
        for _ in range(20):
            fn(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn(x)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6

    rows = {}
    for bs, hidden in [(1, 4096), (64, 4096), (1, 8192), (64, 8192)]:
        x = torch.full((bs, hidden), float(rank + 1), dtype=torch.bfloat16, device="cuda")
        expected = world * (world + 1) / 2
        y = x.clone()
        symm(y)
        assert torch.all(y == expected), "symmetric-memory all-reduce gave a wrong sum"
        rows[f"{bs}x{hidden}"] = {"nccl_us": round(time_us(lambda t: dist.all_reduce(t, group=group), x.clone()), 2),
                                  "symm_one_shot_us": round(time_us(symm, x.clone()), 2)}
    queue.put((rank, rows))
    dist.destroy_process_group()


def phase_allreduce(world: int) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = random.randint(20000, 40000)
    procs = [ctx.Process(target=_allreduce_rank, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    rows = dict(queue.get(timeout=120) for _ in procs)[0]
    for p in procs:
        p.join(timeout=30)
    _record({"phase": "allreduce", "world": world, "per_call": rows})


# -- correctness -----------------------------------------------------------------------------------
def write_random_checkpoint(model: str) -> str:
    """A safetensors checkpoint of random bf16 weights (normal(0, 0.02), norms 1) in HF naming, made
    once per model: every TP/PP layout then loads the same weights, sharded at load."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = os.path.join(CKPT_ROOT, os.path.basename(os.path.normpath(model)))
    if os.path.exists(os.path.join(folder, "done")):
        return folder
    os.makedirs(folder, exist_ok=True)
    src = _config_dir(model)
    cfg = AutoConfig.from_pretrained(src)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    shard, shard_bytes, index = {}, 0, 0
    for name, p in meta.named_parameters():
        if name.endswith("norm.weight"):
            t = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            t = torch.empty(p.shape, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=gen)
            t = t.to(torch.bfloat16).cpu()
        shard[name] = t
        shard_bytes += t.numel() * 2
        if shard_bytes > 4 * 2**30:
            save_file(shard, os.path.join(folder, f"model-{index:05d}.safetensors"))
            shard, shard_bytes, index = {}, 0, index + 1
    if shard:
        save_file(shard, os.path.join(folder, f"model-{index:05d}.safetensors"))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(folder, "config.json"), "w") as g:
        g.write(f.read())
    open(os.path.join(folder, "done"), "w").close()
    return folder


def _teacher_forced(folder: str, tp: int, pp: int, prompts: list[list[int]]) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=folder, tensor_parallel_size=tp, pipeline_parallel_size=pp, skip_tokenizer_init=True,
              max_model_len=2048, gpu_memory_utilization=0.6)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, prompt_logprobs=1, logprobs=1,
                            detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = {"prompt_lp": [], "ids": [], "top2_margin": []}
    for p, o in zip(prompts, outs):
        result["prompt_lp"].append([None if d is None else d[tok].logprob for tok, d in zip(p, o.prompt_logprobs)])
        result["ids"].append(list(o.outputs[0].token_ids))
    del llm
    return result


def _correct_prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(0, 10000) for _ in range(n)] for n in (7, 33, 128, 257, 600, 1000)]


def phase_correct_run(model: str, tp: int, pp: int, path: str) -> None:
    """One layout's outputs on the shared checkpoint, written to ``path`` (its own process, so
    that the previous layout's GPU memory is gone)."""
    with open(path, "w") as f:
        json.dump(_teacher_forced(write_random_checkpoint(model), tp, pp, _correct_prompts()), f)


def phase_correct(model: str) -> None:
    import tempfile

    write_random_checkpoint(model)
    runs = {}
    for tp, pp in [(1, 1), (2, 1), (1, 2)]:
        t0 = time.perf_counter()
        path = tempfile.mktemp(suffix=".json")
        subprocess.run([sys.executable, __file__, "--one", f"correct-run:{model}:{tp}:{pp}:{path}"], check=True)
        runs[(tp, pp)] = json.load(open(path))
        print(f"{model} tp={tp} pp={pp}: {time.perf_counter() - t0:.1f} s", flush=True)
    base = runs[(1, 1)]
    for (tp, pp), run in runs.items():
        if (tp, pp) == (1, 1):
            continue
        diffs = [abs(a - b) for pa, pb in zip(base["prompt_lp"], run["prompt_lp"]) for a, b in zip(pa, pb)
                 if a is not None and b is not None]
        same = sum(a == b for ia, ib in zip(base["ids"], run["ids"]) for a, b in zip(ia, ib))
        total = sum(len(i) for i in base["ids"])
        prefix = [next((k for k, (a, b) in enumerate(zip(ia, ib)) if a != b), len(ia))
                  for ia, ib in zip(base["ids"], run["ids"])]
        _record({"phase": "correct", "model": model, "tp": tp, "pp": pp, "positions": len(diffs),
                 "prompt_logprob_abs_diff_mean": sum(diffs) / len(diffs), "prompt_logprob_abs_diff_max": max(diffs),
                 "greedy_same_positions": same / total, "greedy_common_prefix": prefix})


# -- scaling -----------------------------------------------------------------------------------
def _decode_step_ms(llm, batch: int, input_len: int, out_len: int, vocab: int) -> float:
    from pagedllm.entrypoints.bench_latency import decode_step_seconds

    rng = random.Random(batch)

    def make_prompts() -> list[list[int]]:
        return [[rng.randrange(0, min(vocab, 100000)) for _ in range(input_len)] for _ in range(batch)]

    step, _, _ = decode_step_seconds(llm, make_prompts, out_len, repeats=2)
    return step * 1e3


def phase_scale(model: str, tp: int, pp: int, throughput: bool = True, batches: tuple[int, ...] = (1,),
                micro_batches: int | None = None) -> None:
    """With ``PAGEDLLM_SYMM_MEM_ALL_REDUCE=0`` in the environment the ranks all-reduce through NCCL
    only (the record says which). ``micro_batches``: pipeline micro-batches in flight (None: the
    engine's default, ``pp``)."""
    from pagedllm import LLM
    from pagedllm.entrypoints.bench_throughput import run_pagedllm
    from pagedllm.entrypoints.bench_workload import make_workload

    cfg = _config(model)
    bandwidth = _copy_bandwidth()
    t0 = time.perf_counter()
    llm = LLM(model=_config_dir(model), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              tensor_parallel_size=tp, pipeline_parallel_size=pp)
    if micro_batches is not None and pp > 1:
        llm.llm_engine.engine_core.set_max_micro_batches(micro_batches)
    entry = {"phase": "scale" if throughput else "decode", "model": model, "tp": tp, "pp": pp,
             "micro_batches": micro_batches or pp,
             "startup_s": time.perf_counter() - t0, "copy_bytes_per_s": bandwidth,
             "symm_all_reduce": os.environ.get("PAGEDLLM_SYMM_MEM_ALL_REDUCE", "1") not in ("0", "false")}
    if throughput:
        wl = make_workload("nano", 256, (100, 1024), (100, 1024), cfg["vocab_size"], 0)
        run_pagedllm(llm, make_workload("random", 16, (64, 64), (8, 8), 10000, 1), 0.6)  # warm-up
        elapsed, produced = run_pagedllm(llm, wl, 0.6)
        entry.update(nano_seconds=elapsed, nano_output_tok_s=produced / elapsed)
    # A decode step reads every weight once: split over the tp ranks, while pp stages run one
    # after another (no gain at batch 1 without several micro-batches in flight).
    entry["weight_floor_ms"] = weight_bytes(cfg) / tp / bandwidth * 1e3
    for bs in batches:
        entry[f"decode_b{bs}_ms"] = _decode_step_ms(llm, bs, 1024, 64 if bs > 1 else 128, cfg["vocab_size"])
    _record(entry)
    del llm


def run_phase(spec: str) -> None:
    kind, *rest = spec.split(":")
    if kind == "allreduce":
        phase_allreduce(int(rest[0]) if rest else 2)
    elif kind == "correct":
        phase_correct(rest[0])
    elif kind == "correct-run":
        phase_correct_run(rest[0], int(rest[1]), int(rest[2]), rest[3])
    elif kind == "scale":
        phase_scale(rest[0], int(rest[1]), int(rest[2]), micro_batches=int(rest[3]) if len(rest) > 3 else None)
    elif kind == "decode":
        phase_scale(rest[0], int(rest[1]), int(rest[2]), throughput=False, batches=(1, 64))
    else:
        raise SystemExit(f"unknown phase {spec!r}")


def _table() -> None:
    if not os.path.exists(RESULTS):
        return
    print("\n| phase | model | tp | pp | figures |\n|---|---|---|---|---|")
    for e in json.load(open(RESULTS)):
        skip = {"phase", "model", "tp", "pp", "date", "commit", "per_call", "greedy_common_prefix"}
        figs = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in e.items() if k not in skip)
        if "per_call" in e:
            figs = json.dumps(e["per_call"])
        print(f"| {e['phase']} | {e.get('model', '')} | {e.get('tp', '')} | {e.get('pp', '')} | {figs} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phases", nargs="*")
    ap.add_argument("--phase-timeout", type=float, default=300)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # run one phase in this process
    ns = ap.parse_args()
    if ns.one:
        run_phase(ns.one)
        return 0
    for spec in ns.phases:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, __file__, "--one", spec], start_new_session=True)
        try:
            rc = proc.wait(timeout=ns.phase_timeout)
        except subprocess.TimeoutExpired:  # a hung collective: the phase's whole process group goes
            rc = "timeout"
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        print(f"== phase {spec}: rc={rc} in {time.perf_counter() - t0:.1f} s", flush=True)
        if rc != 0:
            _record({"phase": spec.split(":")[0], "spec": spec, "failed": str(rc)})
    _table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
