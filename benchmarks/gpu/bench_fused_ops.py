"""Before/after the fused layer kernels: Qwen3-0.6B-shaped decode forward on the GPU (not a test).

Run from the repo root on the device: ``PYTHONPATH=. python tests/layers/bench_fused_ops.py``.
Random bf16 weights (``benchmarks/configs/qwen3-0.6b``), a pure decode batch (query_len 1, every
request ``CONTEXT`` tokens of random KV) through the Triton attention backend. For each batch size
and each path (torch ops vs fused kernels): eager forward time, CUDA-graph replay time (CUDA events,
median of several repeats) and the CUDA kernels one forward launches (torch.profiler).

Measured on an H200 (torch 2.11, Triton 3.6), 512 tokens of context, decoder forward only:

| batch | path | eager ms | CUDA graph ms | kernels / forward |
|---|---|---|---|---|
| 1 | torch ops | 18.09 | 3.82 | 1801 |
| 1 | fused | 10.58 | 1.38 | 338 |
| 256 | torch ops | 22.42 | 8.48 | 1745 |
| 256 | fused | 10.14 | 5.10 | 282 |
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter

import torch
from transformers import AutoConfig

from pagedllm.attention.backend import forward_context
from pagedllm.attention.triton_backend import TritonBackend
from pagedllm.config import KernelConfig
from pagedllm.layers import prepare_model_kernels
from pagedllm.models import build_model, init_dummy_weights
from tests.helpers import build_metadata

CONTEXT = 512
BLOCK_SIZE = 16
BATCHES = [int(b) for b in sys.argv[1:]] or [1, 256]


def time_ms(fn, iters: int, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def count_kernels(fn) -> tuple[int, Counter]:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(names.values()), names


def graphed(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@torch.inference_mode()
def main() -> None:
    cfg = AutoConfig.from_pretrained("benchmarks/configs/qwen3-0.6b")
    model = init_dummy_weights(build_model(cfg, torch.bfloat16, "cuda"), seed=0)
    blocks_per_req = (CONTEXT + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = max(BATCHES) * blocks_per_req
    caches = [torch.empty(model.kv_cache_shape_per_layer(num_blocks, BLOCK_SIZE), dtype=torch.bfloat16, device="cuda")
              for _ in range(model.num_attention_layers)]
    for c in caches:
        c.normal_()
    model.bind_kv_caches(caches)
    backend = TritonBackend()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | Qwen3-0.6B shapes, bf16, "
          f"{cfg.num_hidden_layers} layers, decode with {CONTEXT} tokens of context per request")
    rows = []
    for batch in BATCHES:
        tables = [list(range(r * blocks_per_req, (r + 1) * blocks_per_req)) for r in range(batch)]
        meta = build_metadata([CONTEXT] * batch, [1] * batch, tables, BLOCK_SIZE, "cuda", backend)
        ids = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
        positions = torch.full((batch,), CONTEXT - 1, device="cuda")

        def forward(meta=meta, ids=ids, positions=positions):
            with forward_context(meta, backend):
                return model(ids, positions)

        outs = {}
        for fused in (False, True):
            prepare_model_kernels(model, torch.device("cuda"), KernelConfig(fused_ops=fused, fold_norms=False))
            outs[fused] = forward().float()
            eager = time_ms(forward, iters=10)
            replay = graphed(forward)
            graph = time_ms(replay, iters=50)
            n_kernels, names = count_kernels(forward)
            rows.append((batch, "fused" if fused else "torch ops", eager, graph, n_kernels))
            print(f"batch {batch:4d} {'fused' if fused else 'torch':6s}: eager {eager:7.3f} ms, graph {graph:7.3f} ms, "
                  f"{n_kernels} kernels/forward ({n_kernels / cfg.num_hidden_layers:.1f}/layer); top: "
                  + ", ".join(f"{n[:40]} x{c}" for n, c in names.most_common(6)))
        rel = ((outs[True] - outs[False]).norm() / outs[False].norm()).item()
        print(f"batch {batch}: fused vs torch hidden states, relative difference {rel:.2e}")
    print("\n| batch | path | eager ms | CUDA graph ms | kernels / forward |")
    print("|---|---|---|---|---|")
    for batch, path, eager, graph, n in rows:
        print(f"| {batch} | {path} | {eager:.3f} | {graph:.3f} | {n} |")


if __name__ == "__main__":
    main()
