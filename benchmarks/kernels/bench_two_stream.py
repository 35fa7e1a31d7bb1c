"""Would two half-batches on two CUDA streams beat one batch? A decode step's attention streams
the KV cache (memory-bound) while its projections at 64-256 rows are short, latency-bound GEMMs;
with the batch split in two and each half's layer chain on its own stream, one half's GEMMs can
run while the other half's attention streams. This times the layer chain alone (qkv GEMM -> split-KV
decode attention -> o GEMM -> gate_up GEMM -> SiLU-and-mul -> down GEMM, per layer; no norms), in
CUDA graphs, three ways: the whole batch, the two halves one after the other, the two halves on two
streams. Contexts are ragged (seeded uniform), every layer has its own KV pages.
Run on the device from the repo root: ``python benchmarks/kernels/bench_two_stream.py``.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from triton.testing import do_bench_cudagraph  # noqa: E402

from pagedllm.attention.triton_kernels import paged_attention  # noqa: E402

MODELS = {  # hidden, q heads, kv heads, head dim, intermediate, layers
    "qwen3-0.6b": (1024, 16, 8, 128, 3072, 28),
    "llama-3.1-8b": (4096, 32, 8, 128, 14336, 32),
}
DEV, DT, BS = "cuda", torch.bfloat16, 16


class Rows:
    """One set of requests: per-layer block tables, seq lens, launch order and output buffer."""

    def __init__(self, lens, tables_per_layer, hq, d):
        self.n = len(lens)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        self.tables = tables_per_layer
        self.qsl = torch.arange(self.n + 1, dtype=torch.int32, device=DEV)
        self.order = torch.tensor(
            sorted(range(self.n), key=lambda r: -lens[r]), dtype=torch.int32, device=DEV
        )
        self.out = torch.empty(self.n, hq, d, dtype=DT, device=DEV)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b", choices=list(MODELS))
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--ragged", type=int, nargs=2, default=[200, 2048])
    ns = ap.parse_args()
    hidden, hq, hkv, d, inter, layers = MODELS[ns.model]
    g = torch.Generator(device=DEV).manual_seed(0)
    ws = [
        (
            torch.randn((hq + 2 * hkv) * d, hidden, device=DEV, dtype=DT, generator=g) * 0.02,
            torch.randn(hidden, hq * d, device=DEV, dtype=DT, generator=g) * 0.02,
            torch.randn(2 * inter, hidden, device=DEV, dtype=DT, generator=g) * 0.02,
            torch.randn(hidden, inter, device=DEV, dtype=DT, generator=g) * 0.02,
        )
        for _ in range(layers)
    ]
    for batch in ns.batches:
        bench_batch(ns.model, batch, ns.ragged, ws, g)
        torch.cuda.empty_cache()


def bench_batch(model: str, batch: int, ragged, ws, g) -> None:
    hidden, hq, hkv, d, inter, layers = MODELS[model]
    scale = d**-0.5
    rng = random.Random(0)
    lens = [rng.randint(*ragged) for _ in range(batch)]
    nblk = [(s + BS - 1) // BS for s in lens]
    kv = torch.randn(2, sum(nblk) * layers, BS, hkv, d, device=DEV, dtype=DT, generator=g)
    perm = torch.randperm(sum(nblk) * layers, device=DEV, generator=g).to(torch.int32)
    tables, used = [], 0
    for _ in range(layers):
        t = torch.zeros(batch, max(nblk), dtype=torch.int32, device=DEV)
        for r, b in enumerate(nblk):
            t[r, :b] = perm[used : used + b]
            used += b
        tables.append(t)
    full = Rows(lens, tables, hq, d)
    by_len = sorted(range(batch), key=lambda r: -lens[r])
    halves = []
    for part in (by_len[0::2], by_len[1::2]):
        idx = torch.tensor(part, device=DEV)
        halves.append(Rows([lens[r] for r in part], [t[idx].contiguous() for t in tables], hq, d))
    x_full = torch.randn(batch, hidden, device=DEV, dtype=DT, generator=g)
    xs = [x_full[: h.n].clone() for h in halves]

    def chain(x, rows: Rows):
        for layer, (wqkv, wo, wgu, wd) in enumerate(ws):
            qkv = F.linear(x, wqkv)
            q = qkv[:, : hq * d].view(rows.n, hq, d)
            paged_attention.paged_decode(
                rows.out, q, kv, rows.tables[layer], rows.seq_lens, rows.qsl, scale, order=rows.order
            )
            o = F.linear(rows.out.view(rows.n, hq * d), wo)
            gu = F.linear(o, wgu)
            x = F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], wd)
        return x

    side = torch.cuda.Stream()

    def two_streams():
        main_stream = torch.cuda.current_stream()
        side.wait_stream(main_stream)
        with torch.cuda.stream(side):
            chain(xs[1], halves[1])
        chain(xs[0], halves[0])
        main_stream.wait_stream(side)

    variants = {
        "one batch": lambda: chain(x_full, full),
        "halves in sequence": lambda: (chain(xs[0], halves[0]), chain(xs[1], halves[1])),
        "halves on two streams": two_streams,
    }
    res = {}
    for name, fn in variants.items():
        fn()
        torch.cuda.synchronize()
        res[name] = 1e3 * do_bench_cudagraph(fn, rep=50, return_mode="median")
    line = " | ".join(f"{k} {v:8.1f} us" for k, v in res.items())
    print(
        f"{model} b{batch}: {line} | two streams / one batch {res['halves on two streams'] / res['one batch']:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
