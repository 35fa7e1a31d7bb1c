"""Profile one mixed step of the nano-bench model on the GPU (eager: a prefill chunk of
``max_num_batched_tokens`` minus the running decodes, plus those decodes), printing its wall
time, the GPU time of each kernel family and the host time of the step. Run from the repo root
on the device: ``python benchmarks/gpu/profile_mixed.py [num_decodes] [prompt_len]``. Last, a
cProfile of the host side of one more mixed step and the step after it (where the eager forward's
Python time goes)."""

import cProfile
import pstats
import random
import sys
import time

import torch

from pagedllm import LLM, SamplingParams

num_decodes = int(sys.argv[1]) if len(sys.argv) > 1 else 64
prompt_len = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
llm = LLM("benchmarks/configs/qwen3-0.6b", load_format="dummy", skip_tokenizer_init=True, max_model_len=4096)
engine = llm.llm_engine
rng = random.Random(0)
params = SamplingParams(temperature=0.6, max_tokens=400, ignore_eos=True, detokenize=False)


def add(prefix: str, n: int) -> None:
    for i in range(n):
        engine.add_request(f"{prefix}{i}", {"prompt_token_ids": [rng.randint(0, 10000) for _ in range(prompt_len)]}, params)


add("d", num_decodes)
while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.engine_core.scheduler.running) or \
        engine.engine_core.scheduler.waiting:
    engine.step()
for _ in range(4):
    engine.step()
torch.cuda.synchronize()
budget = engine.config.scheduler_config.max_num_batched_tokens
times = []
for round_ in range(4):
    add(f"p{round_}_", budget // prompt_len + 1)
    torch.cuda.synchronize()
    if round_ < 2:
        t0 = time.perf_counter()
        engine.step()
        engine.step()  # the mixed step's results come back one step later (async scheduling)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        while engine.engine_core.scheduler.waiting or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in engine.engine_core.scheduler.running):
            engine.step()
        continue
    if round_ == 2:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.step()
            engine.step()
            torch.cuda.synchronize()
        while engine.engine_core.scheduler.waiting or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in engine.engine_core.scheduler.running):
            engine.step()
        continue
    host = cProfile.Profile()
    host.enable()
    engine.step()
    engine.step()
    torch.cuda.synchronize()
    host.disable()
print(f"{num_decodes} decodes + prefill chunk of {budget}: two steps (mixed + next) wall {times} ms")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
pstats.Stats(host).sort_stats("tottime").print_stats(25)
