"""Does programmatic dependent launch shorten a chain of batch-1 GEMVs shaped like Llama-8B's
layers (qkv, o, gate_up, down; LAYERS=32 layers of distinct random weights), and where should a
kernel allow the next launch? A plain Triton GEMV, four variants in one CUDA graph each: PDL off;
launch_dependents right after the wait (as the dropped tenth-session experiment); after the K loop;
after the K loop with the first weight chunk loaded (into registers) before the wait.
Usage on the GPU machine: python benchmarks/kernels/bench_pdl_chain.py out.json"""
import json
import os
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def gemv(w_ptr, x_ptr, y_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
         MODE: tl.constexpr):
    # MODE 0 off, 1 trigger at start, 2 trigger at end, 3 prefetch + trigger at end
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * K + cols[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if MODE == 3:
        w0 = tl.load(w_ptrs)
    if MODE != 0:
        tl.extra.cuda.gdc_wait()
    if MODE == 1:
        tl.extra.cuda.gdc_launch_dependents()
    if MODE == 3:
        x0 = tl.load(x_ptr + cols)
        acc += w0.to(tl.float32) * x0.to(tl.float32)[None, :]
        start = BLOCK_K
    else:
        start = 0
    for k in range(start, K, BLOCK_K):
        w = tl.load(w_ptrs + k)
        x = tl.load(x_ptr + k + cols)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    if MODE >= 2:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))


CFG = {  # (N, K): (BLOCK_N, BLOCK_K, warps)
    (6144, 4096): (8, 512, 4), (4096, 4096): (8, 1024, 8),
    (28672, 4096): (8, 512, 4), (4096, 14336): (8, 512, 4)}


def main(out_path):
    dev = "cuda"
    L = int(os.environ.get("LAYERS", "32"))
    torch.manual_seed(0)
    layers = []
    for _ in range(L):
        layers.append([torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5 for n, k in CFG])
    x0 = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    bufs = {n: torch.empty(n, device=dev, dtype=torch.bfloat16) for n, _ in CFG}

    def chain(mode):
        x = x0
        for ws in layers:
            for w in ws:
                n, k = w.shape
                bn, bk, nw = CFG[(n, k)]
                y = bufs[n]
                gemv[(n // bn,)](w, x, y, k, BLOCK_N=bn, BLOCK_K=bk, MODE=mode, num_warps=nw,
                                 num_stages=3, launch_pdl=mode != 0)
                x = y[: {6144: 4096, 4096: 4096, 28672: 14336}[n]]
        return x

    res = {}
    refs = {}
    graphs = {}
    for mode in (0, 1, 2, 3):
        for _ in range(2):
            chain(mode)
        torch.cuda.synchronize()
        refs[mode] = chain(mode).float().clone()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            chain(mode)
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=s):
                chain(mode)
        torch.cuda.synchronize()
        graphs[mode] = g
    wbytes = sum(w.numel() * 2 for ws in layers for w in ws)
    times = {m: [] for m in graphs}
    for _ in range(7):
        for m, g in graphs.items():
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(10):
                g.replay()
            e1.record()
            torch.cuda.synchronize()
            times[m].append(e0.elapsed_time(e1) / 10 * 1e3)
    final = {}
    for m, g in graphs.items():
        g.replay()
        torch.cuda.synchronize()
        final[m] = (bufs[4096].float() - refs[0]).abs().max().item()
    print("graph output diff vs eager off:", final, flush=True)
    names = {0: "off", 1: "trigger at start", 2: "trigger at end", 3: "prefetch + trigger at end"}
    for m in graphs:
        t = sorted(times[m])[len(times[m]) // 2]
        err = (refs[m] - refs[0]).abs().max().item()
        res[names[m]] = {"median_us": t, "min_us": min(times[m]), "tb_per_s": wbytes / t / 1e6,
                         "max_abs_diff_vs_off": err}
        print(f"{names[m]:28s} {t:9.1f} us  {wbytes / t / 1e6:5.2f} TB/s  diff {err:.3g}", flush=True)
    res["graph_diff"] = {str(k): v for k, v in final.items()}
    res["weight_bytes"] = wbytes
    res["kernels"] = 4 * L
    res["device"] = torch.cuda.get_device_name()
    json.dump(res, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
