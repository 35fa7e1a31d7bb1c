"""Profile steady-state decode steps of the nano-bench model on the GPU: per-phase CUDA times
(graph replay, logits, sampling) and the top kernels. Run from the repo root on the device:
``python benchmarks/gpu/profile_decode.py [BATCH [CONTEXT [MODEL_CONFIG_DIR]]]``."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.gpu.decode_setup import decoding_engine  # noqa: E402
from pagedllm import SamplingParams  # noqa: E402

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 256
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
model = sys.argv[3] if len(sys.argv) > 3 else "benchmarks/configs/qwen3-0.6b"
llm, engine = decoding_engine(batch, ctx, max_tokens=200, model=model)
runner = engine.engine_core.runner


def cuda_ms(fn, n=20):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / n


t0 = time.perf_counter()
for _ in range(20):
    engine.step()
torch.cuda.synchronize()
step_ms = (time.perf_counter() - t0) / 20 * 1e3
gr = runner.graph_runner
bs = gr.padded_size(batch)
replay_ms = cuda_ms(lambda: gr.replay(bs))
logits = gr.outputs[bs, 1][:batch]  # the graph ends with the LM head
from pagedllm.sample.sampler import build_sampling_metadata  # noqa: E402

params = [SamplingParams(temperature=0.6)] * batch
try:
    meta = build_sampling_metadata(params, [10] * batch, runner.device)
except TypeError:
    meta = None
sample_ms = cuda_ms(lambda: runner.sampler(logits, meta)) if meta is not None else float("nan")
ct = engine.engine_core.step_timings
print(f"batch {batch} ctx ~{ctx}: wall step {step_ms:.2f} ms | graph replay (to the logits) {replay_ms:.2f} ms | "
      f"sampler {sample_ms:.2f} ms")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
