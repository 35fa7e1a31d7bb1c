"""Host side of steady batch-1 decode (what ``pagedllm bench latency --batch-size 1`` times):
wall time per step, GPU time per step (CUDA events around the whole generate), the engine's
phase timings, and a cProfile of the host (top functions by own time). Run from the repo root on
the device: ``python benchmarks/gpu/profile_host.py [MODEL_CONFIG_DIR [INPUT_LEN [OUTPUT_LEN]]]``."""

import cProfile
import pstats
import random
import sys
import time

import torch

from pagedllm import LLM, SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/configs/qwen3-0.6b"
input_len = int(sys.argv[2]) if len(sys.argv) > 2 else 512
output_len = int(sys.argv[3]) if len(sys.argv) > 3 else 512
llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096)
engine = llm.llm_engine
rng = random.Random(0)


def run(n: int) -> float:
    prompt = [rng.randint(0, 10000) for _ in range(input_len)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, detokenize=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - t0


run(4)
t1 = min(run(1) for _ in range(2))
tn = min(run(output_len) for _ in range(2))
print(f"{model} b1: {(tn - t1) / (output_len - 1) * 1e3:.3f} ms per step")
core, runner = engine.engine_core, engine.engine_core.runner
for d in (core.step_timings, runner.timings):
    for k in d:
        d[k] = 0.0
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    run(64)
events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
gpu_us = sum(e.time_range.elapsed_us() for e in events)
print(f"GPU busy per step (profiled run of 64 tokens): {gpu_us / 64:.1f} us over {len(events) / 64:.0f} kernels/copies")
steps = core.step_timings["steps"] or 1
print("engine phases per step (us):", {k: round(v / steps * 1e6, 1) for k, v in core.step_timings.items() if k != "steps"},
      "runner:", {k: round(v / steps * 1e6, 1) for k, v in runner.timings.items()})
host = cProfile.Profile()
host.enable()
run(256)
host.disable()
st = pstats.Stats(host)
st.sort_stats("tottime").print_stats(30)
st.sort_stats("cumulative").print_stats(40)
