"""The GPU timeline of steady decode steps: every kernel and copy between two graph replays, with
its duration and the idle gap before it (what a step spends outside its CUDA graph). Run from the
repo root on the device: ``python benchmarks/gpu/timeline_decode.py [BATCH [CONTEXT [TEMPERATURE [MODEL]]]]``
(MODEL: a config folder, default ``benchmarks/configs/qwen3-0.6b``).
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.gpu.decode_setup import decoding_engine  # noqa: E402

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 512
temperature = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
model = sys.argv[4] if len(sys.argv) > 4 else "benchmarks/configs/qwen3-0.6b"
_, engine = decoding_engine(batch, ctx, temperature=temperature, max_tokens=400, decode_steps=24, model=model)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(50):
    engine.step()
torch.cuda.synchronize()
print(f"batch {batch}, temperature {temperature}: {(time.perf_counter() - t0) / 50 * 1e3:.3f} ms per step unprofiled")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(6):
        engine.step()
    torch.cuda.synchronize()
path = os.path.join(tempfile.mkdtemp(), "trace.json")
prof.export_chrome_trace(path)
events = [e for e in json.load(open(path))["traceEvents"]
          if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
events.sort(key=lambda e: e["ts"])
# Layer kernels (those launched at least once per layer per step) belong to the graph replay; a
# step's "outside" part is everything between one replay's last layer kernel and the next one's.
num_layers = engine.config.model_config.hf_config.num_hidden_layers
counts: dict[str, int] = {}
for e in events:
    counts[e["name"]] = counts.get(e["name"], 0) + 1
in_graph = [counts[e["name"]] >= 6 * num_layers for e in events]
rows, prev_end = [], None
for e, g in zip(events, in_graph):
    rows.append((e["name"][:70], e["dur"], 0.0 if prev_end is None else e["ts"] - prev_end, g))
    prev_end = e["ts"] + e["dur"]
# Print steps 2-3 of the window as runs: one line per outside op, one line per graph run.
runs, i = [], 0
while i < len(rows):
    j = i
    while j < len(rows) and rows[j][3] == rows[i][3] and (rows[i][3] or j == i):
        j += 1
    chunk = rows[i:j]
    runs.append((rows[i][3], chunk))
    i = j
graph_runs = [k for k, (g, _) in enumerate(runs) if g]
for a, b in zip(graph_runs[1:3], graph_runs[2:4]):
    outside = [c[0] for g, c in runs[a + 1 : b]]
    _, graph = runs[a]
    span = sum(d + gap for _, d, gap, _ in graph) - graph[0][2]
    print(f"--- graph: {len(graph)} kernels, {sum(d for _, d, _, _ in graph):.1f} us busy over {span:.1f} us")
    for name, dur, gap, _ in outside:
        print(f"  {dur:7.1f} us  (gap before {gap:5.1f})  {name}")
    print(f"  next graph starts after a gap of {runs[b][1][0][2]:.1f} us; outside: "
          f"{sum(o[1] for o in outside):.1f} us busy, {sum(o[2] for o in outside) + runs[b][1][0][2]:.1f} us gaps")
