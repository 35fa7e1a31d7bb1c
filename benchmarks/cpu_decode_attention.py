"""CPU decode attention per layer call: the native kernel (reads K/V in place from the pages)
against the torch path (gather the pages of each group of similar lengths, then SDPA).

SmolLM2-135M's head shapes (9 query heads, 3 KV heads, head size 64), 64 requests with contexts
of 40-500 tokens over shuffled 16-token blocks; the KV cache of one layer (~27 MB) fits this
machine's L3, so this times the kernels, not DRAM. Both are checked against each other first.
Interleaved repeats; the minimum of each is reported. Usage: ``python benchmarks/cpu_decode_attention.py``.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pagedllm.attention.torch_ref import _decode_group, plan_decode_groups  # noqa: E402
from pagedllm.native import kernels as native  # noqa: E402


def main() -> None:
    if native.load() is None:
        sys.exit("the native CPU kernels could not be built (no C compiler?)")
    rng = random.Random(0)
    torch.manual_seed(0)
    num_reqs, heads, kv_heads, head_dim, block = 64, 9, 3, 64, 16
    lens = [rng.randint(40, 500) for _ in range(num_reqs)]
    blocks_per_req = [(n + block - 1) // block for n in lens]
    num_blocks = sum(blocks_per_req) + 8
    perm = torch.randperm(num_blocks).int()
    tables = torch.zeros(num_reqs, max(blocks_per_req), dtype=torch.int32)
    used = 0
    for r, nb in enumerate(blocks_per_req):
        tables[r, :nb] = perm[used:used + nb]
        used += nb
    kv = torch.randn(2, num_blocks, block, kv_heads, head_dim)
    q = torch.randn(num_reqs, heads, head_dim)
    rows = torch.arange(num_reqs)
    seq_lens = torch.tensor(lens)
    scale = head_dim ** -0.5
    plan = plan_decode_groups(lens, list(range(num_reqs)), tables, block, q.device)
    out_native, out_torch = torch.zeros_like(q), torch.zeros_like(q)

    def run_native():
        native.paged_decode_attention(q, kv, out_native, tables, rows, rows, seq_lens, scale)

    def run_torch():
        for group in plan.groups:
            _decode_group(q, kv, group, scale, out_torch)

    run_native()
    run_torch()
    torch.testing.assert_close(out_native, out_torch, rtol=1e-5, atol=1e-5)
    best = {"native": float("inf"), "torch": float("inf")}
    for _ in range(5):
        for name, fn in (("native", run_native), ("torch", run_torch)):
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / 20 * 1e3)
    kv_mb = sum(lens) * kv_heads * head_dim * 2 * 4 / 1e6
    print(f"{num_reqs} decodes, {sum(lens)} keys ({kv_mb:.1f} MB of K/V), {torch.get_num_threads()} threads: "
          f"native {best['native']:.3f} ms, torch gather + SDPA {best['torch']:.3f} ms "
          f"({best['torch'] / best['native']:.1f}x)")


if __name__ == "__main__":
    main()
