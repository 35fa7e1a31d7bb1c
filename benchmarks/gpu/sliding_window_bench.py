"""Sliding window and logit soft cap in the Triton attention kernels: time and bandwidth, one script.

Questions it answers:
1. window=None: is the kernels' speed unchanged? (the "full" rows: compare them with
   ``benchmarks/kernels/bench_attention.py`` from before this change on the same GPU);
2. a window of W keys: does decode read only W keys per request (time ~ W / context of the full
   row, bandwidth of the keys actually read close to the full row's)? Prefill chunks likewise;
3. a soft cap (Gemma 2's 50): what does the tanh per score cost on a decode step and a prefill?

Shapes: Mistral-7B attention (32 query heads, 8 KV heads, head 128, blocks of 16, bf16, window
4096) and Gemma-2-9B's (16 / 8 heads, head 256, window 4096, cap 50). Every variant is checked
against the torch reference once before it is timed (CUDA-graph replays, median).

Prints a table and writes ``$OUT/sliding-window-kernels.json`` (``--out`` to change). From the
repo root on the GPU machine (about a minute):

    python benchmarks/gpu/sliding_window_bench.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.kernels.bench_attention import time_us  # noqa: E402
from pagedllm.attention.torch_ref import TorchRefBackend  # noqa: E402
from pagedllm.attention.triton_kernels import paged_attention  # noqa: E402
from tests.attention.test_triton_backend import attend, make_inputs, rel_err  # noqa: E402

# (name, num_heads, num_kv_heads, head_dim, window, soft_cap)
MODELS = [("mistral-7b", 32, 8, 128, 4096, None), ("gemma-2-9b", 16, 8, 256, 4096, 50.0)]
# (name, [(seq_len, query_len)]): decode batches and one prefill chunk over a long context.
WORKLOADS = [
    ("decode B=1 ctx=32768", [(32768, 1)]),
    ("decode B=16 ctx=16384", [(16384, 1)] * 16),
    ("decode B=64 ctx=4096", [(4096, 1)] * 64),
    ("prefill 2048 at ctx=16384", [(16384, 2048)]),
]


def keys_read(specs, window: int | None) -> int:
    """Key positions the kernels must read: each query row's visible span, once per request."""
    total = 0
    for seq, q_len in specs:
        first = 0 if window is None else max(0, seq - q_len - window + 1)
        total += seq - first
    return total


def run_case(model, workload, window, soft_cap, copy_gbps) -> dict:
    name, num_heads, num_kv_heads, head_dim, _, _ = model
    wname, specs = workload
    gen = torch.Generator().manual_seed(0)
    query, key, value, kv_cache, common = make_inputs(
        specs, block_size=16, num_kv_heads=num_kv_heads, qpk=num_heads // num_kv_heads, head_dim=head_dim,
        dtype=torch.bfloat16, device="cuda", gen=gen, num_pad_tokens=0,
    )
    options = {"sliding_window": window, "logits_soft_cap": soft_cap}
    ref = attend(TorchRefBackend(), query, key, value, kv_cache, common, head_dim**-0.5, **options)
    out = torch.empty_like(query)
    args = (out, query, kv_cache, common.block_tables, common.seq_lens, common.query_start_loc)
    scale = head_dim**-0.5
    if common.max_query_len == 1:
        def fn():
            paged_attention.paged_decode(*args, scale, **options)
    else:
        def fn():
            paged_attention.unified_attention(*args, common.max_query_len, scale, **options)
    fn()
    err = rel_err(out, ref)
    assert err < 2e-2, f"{name} {wname} window={window} cap={soft_cap}: relative error {err:.2e}"
    us = time_us(fn, graph=True)
    kv_bytes = keys_read(specs, window) * num_kv_heads * head_dim * 2 * kv_cache.element_size()
    return {"model": name, "workload": wname, "window": window, "soft_cap": soft_cap, "us": round(us, 2),
            "kv_gbps": round(kv_bytes / us / 1e3, 1), "of_copy": round(kv_bytes / us / 1e3 / copy_gbps, 3),
            "rel_err": err}


def copy_bandwidth_gbps() -> float:
    """Measured device copy bandwidth (bytes read + written per second, in GB/s)."""
    src = torch.empty(512 * 2**20, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / time_us(lambda: dst.copy_(src), graph=True) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    copy_gbps = copy_bandwidth_gbps()
    rows = []
    print(f"{torch.cuda.get_device_name()}; copy (read + write) {copy_gbps:.0f} GB/s")
    print(f"{'model':12s} {'workload':28s} {'variant':18s} {'us':>9s} {'KV GB/s':>8s} {'of copy':>8s}")
    for model in MODELS:
        _, _, _, _, window, cap = model
        variants = [("full", None, None), (f"window {window}", window, None)]
        if cap is not None:
            variants += [(f"full, cap {cap:g}", None, cap), (f"window, cap {cap:g}", window, cap)]
        for workload in WORKLOADS:
            for label, w, c in variants:
                row = run_case(model, workload, w, c, copy_gbps)
                rows.append(row)
                print(f"{model[0]:12s} {workload[0]:28s} {label:18s} {row['us']:9.1f} {row['kv_gbps']:8.0f} "
                      f"{row['of_copy']:8.2f}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "sliding-window-kernels.json"
    path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_gbps": copy_gbps, "rows": rows},
                               indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
