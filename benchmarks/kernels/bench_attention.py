"""Micro-benchmark of the Triton attention kernels (GPU only).

Prints every figure as a fraction of its physical limit, measured in the same run:
- decode: KV bytes that must be read (sum of seq_lens * num_kv_heads * head_dim * 2 (K and V) *
  element size) over the kernel time, against a device-to-device copy (bytes read + written);
- prefill: attention FLOPs (causal: 4 * heads * head_dim * visible keys per query) over the time.

Decode is timed inside CUDA graphs (``do_bench_cudagraph``; the decode path is graph capturable,
and that is how the engine runs it), rotating over 4 disjoint input sets so that the KV of one
call is not still in L2 for the next; prefill with ``do_bench`` (it flushes L2 between calls).
Also times, briefly, torch's own options where this torch has them: ``varlen_attn`` (FlashAttention,
contiguous K/V, optionally paged) and FlexAttention (compiled, contiguous K/V).

Usage: ``python benchmarks/kernels/bench_attention.py --out results.json`` (from the repo root).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import inspect
import itertools
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from pagedllm.attention.backend import CommonAttentionInputs  # noqa: E402
from pagedllm.attention.triton_backend import TritonBackend  # noqa: E402
from pagedllm.attention.triton_kernels import paged_attention  # noqa: E402

QWEN3_06B = dict(num_heads=16, num_kv_heads=8, head_dim=128, block_size=16)  # Qwen3-0.6B attention
DTYPE = torch.bfloat16
DEVICE = "cuda"
ROTATE = 4
ROWS: list[dict] = []


def log(msg: str) -> None:
    print(msg, flush=True)


def record(**row) -> dict:
    ROWS.append(row)
    log("  " + json.dumps(row))
    return row


def _record_bandwidth(case: str, nbytes: int, copy_gbps: float, impl: str, us: float, **extra) -> None:
    gbps = nbytes / us / 1e3
    record(
        case=case,
        impl=impl,
        us=round(us, 2),
        kv_bytes=nbytes,
        gbps=round(gbps, 1),
        frac_copy=round(gbps / copy_gbps, 3),
        **extra,
    )


def _record_flops(case: str, flops: float, impl: str, us: float, **extra) -> None:
    record(case=case, impl=impl, us=round(us, 1), tflops=round(flops / us / 1e6, 1), **extra)


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of a 1 GiB buffer, counting bytes read plus bytes written."""
    src = torch.randn(512 * 2**20, device=DEVICE, dtype=DTYPE)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * 2**30 / (ms * 1e-3) / 1e9


class Batch:
    """``sets`` independent batches with the same lengths over one cache (disjoint, shuffled blocks).

    ``layout``: ``"nhd"`` stores each block as ``[block_size, num_kv_heads, head_dim]`` (the engine's
    layout); ``"hnd"`` as ``[num_kv_heads, block_size, head_dim]``, handed to the kernels as a
    permuted view of the same logical shape (they take strides)."""

    def __init__(self, seq_lens, query_lens, sets=1, seed=0, layout="nhd", **shape):
        self.shape = dict(QWEN3_06B, **shape)
        hq, hkv, d, bs = (self.shape[k] for k in ("num_heads", "num_kv_heads", "head_dim", "block_size"))
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.seq_lens, self.query_lens = list(seq_lens), list(query_lens)
        nblk = [math.ceil(s / bs) for s in self.seq_lens]
        total = sum(nblk) * sets
        if layout == "hnd":
            self.kv_cache = torch.randn(2, total, hkv, bs, d, device=DEVICE, dtype=DTYPE, generator=gen).transpose(2, 3)
        else:
            self.kv_cache = torch.randn(2, total, bs, hkv, d, device=DEVICE, dtype=DTYPE, generator=gen)
        perm = torch.randperm(total, device=DEVICE, generator=gen).to(torch.int32)
        qsl = [0] + list(itertools.accumulate(self.query_lens))
        n = qsl[-1]
        self.sets = []
        used = 0
        for _ in range(sets):
            tables = torch.zeros(len(nblk), max(nblk), dtype=torch.int32, device=DEVICE)
            for r, b in enumerate(nblk):
                tables[r, :b] = perm[used : used + b]
                used += b
            pos = torch.cat([torch.arange(s - q, s) for s, q in zip(self.seq_lens, self.query_lens)]).to(
                DEVICE
            )
            req = torch.repeat_interleave(torch.arange(len(nblk)), torch.tensor(self.query_lens)).to(DEVICE)
            slots = (tables[req, pos // bs].long() * bs + pos % bs).long()
            meta = TritonBackend.metadata_builder.build(CommonAttentionInputs(
                num_actual_tokens=n,
                max_query_len=max(self.query_lens),
                query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
                seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=DEVICE),
                block_tables=tables,
                slot_mapping=slots,
            ))
            q = torch.randn(n, hq, d, device=DEVICE, dtype=DTYPE, generator=gen)
            k = torch.randn(n, hkv, d, device=DEVICE, dtype=DTYPE, generator=gen)
            v = torch.randn(n, hkv, d, device=DEVICE, dtype=DTYPE, generator=gen)
            self.sets.append((q, k, v, meta, torch.empty_like(q)))
        self._next = itertools.cycle(range(sets))
        self.scale = d**-0.5

    def kv_bytes(self) -> int:
        s = self.shape
        return sum(self.seq_lens) * s["num_kv_heads"] * s["head_dim"] * 2 * DTYPE.itemsize

    def attn_flops(self) -> float:
        """Causal attention FLOPs: QK^T and PV, 2 FLOPs per multiply-add, over visible keys."""
        s = self.shape
        visible = sum(q * (sk - q) + q * (q + 1) / 2 for sk, q in zip(self.seq_lens, self.query_lens))
        return 4 * s["num_heads"] * s["head_dim"] * visible

    def fn(self, kind: str, **kw):
        def run():
            q, k, v, meta, out = self.sets[next(self._next)]
            args = (out, q, self.kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
            if kind == "decode":
                paged_attention.paged_decode(*args, self.scale, **kw)
            elif kind == "unified":
                paged_attention.unified_attention(*args, meta.max_query_len, self.scale, **kw)
            else:  # the whole backend forward: KV store + attention
                TritonBackend().forward(q, k, v, self.kv_cache, meta, self.scale, out=out)

        return run


def _kw(kw: dict) -> str:
    short = dict(block_m="bm", tile_n="tn", num_warps="w", num_stages="st")
    return " ".join(f"{short.get(k, k)}{v}" for k, v in kw.items()) or "default"


def timed(rec, label: str, fn, graph: bool, **extra) -> None:
    """Time ``fn`` and record it; a failure (e.g. a config out of shared memory) becomes a note."""
    try:
        rec(label, time_us(fn, graph), **extra)
    except Exception as e:  # noqa: BLE001
        case = rec.args[0] if isinstance(rec, functools.partial) else "note"
        record(case=case, impl=label, error=repr(e)[:300])


def time_us(fn, graph: bool) -> float:
    fn()
    torch.cuda.synchronize()
    if graph:
        return 1e3 * do_bench_cudagraph(fn, rep=30, return_mode="median")
    return 1e3 * do_bench(fn, warmup=10, rep=60, return_mode="median")


def bench_decode(copy_gbps: float, quick: bool) -> None:
    cases = [
        ("decode B=256 ctx~1100", [int(x) for x in torch.randint(1000, 1201, (256,)).tolist()]),
        ("decode B=1 ctx=8192", [8192]),
        ("decode B=32 ctx=4096", [4096] * 32),
        ("decode B=4 ctx=2048", [2048] * 4),
    ]
    variants = (
        [dict()]
        if quick
        else [
            dict(),  # tile_n=64, num_warps=2, num_stages=3
            dict(tile_n=64, num_warps=4),
            dict(tile_n=32, num_warps=2),
            dict(tile_n=128, num_warps=4),
            dict(tile_n=64, num_warps=2, num_stages=2),
        ]
    )
    for name, lens in cases:
        log(name)
        b = Batch(lens, [1] * len(lens), sets=ROTATE)
        nbytes = b.kv_bytes()
        splits = paged_attention.decode_num_splits(len(lens), b.shape["num_kv_heads"], _sms())

        rec = functools.partial(_record_bandwidth, name, nbytes, copy_gbps)

        timed(rec, "triton split-kv (graph)", b.fn("decode"), True, num_splits=splits)
        timed(rec, "triton split-kv (eager)", b.fn("decode"), False, num_splits=splits)
        timed(rec, "triton backend.forward (graph)", b.fn("forward"), True)
        timed(rec, "triton unified, no split (graph)", b.fn("unified"), True)
        for kw in variants[1:]:
            timed(rec, f"triton split-kv {_kw(kw)}", b.fn("decode", **kw), True, num_splits=splits)
        if len(lens) <= 4 and not quick:
            for s in (8, 16, 32, 64):
                timed(
                    rec, f"triton split-kv num_splits={s}", b.fn("decode", num_splits=s), True, num_splits=s
                )
        _torch_decode_peers(b, rec)
        del b
        torch.cuda.empty_cache()


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:  # noqa: BLE001
        return None, set()
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def _torch_decode_peers(b: Batch, rec) -> None:
    """torch varlen_attn (FlashAttention): paged if this torch supports block_table, else on K/V
    gathered into contiguous memory first (gather timed separately)."""
    varlen_attn, params = _varlen()
    if varlen_attn is None:
        return
    q, _, _, meta, _ = b.sets[0]
    hq, hkv = b.shape["num_heads"], b.shape["num_kv_heads"]
    cu_q = meta.query_start_loc
    seq = meta.seq_lens
    cu_k = torch.nn.functional.pad(seq.cumsum(0), (1, 0)).to(torch.int32)
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}
    try:
        if "block_table" in params:
            kc, vc = b.kv_cache[0], b.kv_cache[1]
            fn = lambda: varlen_attn(  # noqa: E731
                q,
                kc,
                vc,
                cu_q,
                None,
                1,
                max(b.seq_lens),
                seqused_k=seq,
                block_table=meta.block_tables,
                scale=b.scale,
                **gqa,
            )
            timed(rec, "torch varlen_attn paged (graph)", fn, True)
    except Exception as e:  # noqa: BLE001
        record(case="note", impl="torch varlen_attn paged", error=repr(e)[:300])
    try:
        k, v = _gather(b, meta)
        if not gqa:
            k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        fn = lambda: varlen_attn(q, k, v, cu_q, cu_k, 1, max(b.seq_lens), scale=b.scale, **gqa)  # noqa: E731
        timed(rec, "torch varlen_attn on gathered K/V (graph)", fn, True, gqa_native=bool(gqa))
        timed(rec, "torch gather of K/V alone (eager)", lambda: _gather(b, meta), False)
    except Exception as e:  # noqa: BLE001
        record(case="note", impl="torch varlen_attn gathered", error=repr(e)[:300])


def _gather(b: Batch, meta) -> tuple[torch.Tensor, torch.Tensor]:
    bs = b.shape["block_size"]
    tables = meta.block_tables.long()
    pos = torch.cat([torch.arange(s, device=DEVICE) for s in b.seq_lens])
    req = torch.repeat_interleave(torch.arange(len(b.seq_lens), device=DEVICE), meta.seq_lens.long())
    slots = tables[req, pos // bs] * bs + pos % bs
    flat = b.kv_cache.view(2, -1, b.shape["num_kv_heads"], b.shape["head_dim"])
    return flat[0, slots], flat[1, slots]


def bench_prefill(quick: bool, flex: bool) -> None:
    cases = [
        ("prefill 8x2048 (full)", [2048] * 8, [2048] * 8),
        ("chunked 4x1024 new over 3072 cached", [4096] * 4, [1024] * 4),
    ]
    variants = (
        [dict()]
        if quick
        else [
            dict(),  # here block_m=128, tile_n=64, num_warps=4, num_stages=3
            dict(block_m=128, tile_n=32),
            dict(block_m=128, num_warps=8),
            dict(block_m=64),
            dict(block_m=128, num_stages=2),
        ]
    )
    for name, seq, ql in cases:
        log(name)
        b = Batch(seq, ql, sets=1)
        flops = b.attn_flops()

        rec = functools.partial(_record_flops, name, flops)

        for kw in variants:
            timed(rec, f"triton unified {_kw(kw)}", b.fn("unified", **kw), False)
        timed(rec, "triton backend.forward", b.fn("forward"), False)
        if seq == ql:
            _torch_prefill_peers(b, rec, flex)
        del b
        torch.cuda.empty_cache()


def _torch_prefill_peers(b: Batch, rec, flex: bool) -> None:
    """Contiguous (non-paged) K/V: FlashAttention through varlen_attn, and FlexAttention."""
    q, k, v, meta, _ = b.sets[0]
    hq, hkv = b.shape["num_heads"], b.shape["num_kv_heads"]
    varlen_attn, params = _varlen()
    if varlen_attn is not None:
        try:
            gqa = {"enable_gqa": True} if "enable_gqa" in params else {}
            kk, vv = (k, v) if gqa else (k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1))
            cu = meta.query_start_loc
            L = max(b.seq_lens)
            causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
            fn = lambda: varlen_attn(q, kk, vv, cu, cu, L, L, scale=b.scale, **causal, **gqa)  # noqa: E731
            timed(rec, "torch varlen_attn (contiguous K/V)", fn, False, gqa_native=bool(gqa))
        except Exception as e:  # noqa: BLE001
            record(case="note", impl="torch varlen_attn prefill", error=repr(e)[:300])
    if not flex:
        return
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.repeat_interleave(torch.arange(len(b.seq_lens), device=DEVICE), meta.seq_lens.long())

        def mask_mod(bi, h, qi, ki):
            return (doc[qi] == doc[ki]) & (qi >= ki)

        T = q.shape[0]
        mask = create_block_mask(mask_mod, None, None, T, T, device=DEVICE)
        compiled = torch.compile(flex_attention)
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        t0 = time.time()
        fn = lambda: compiled(qt, kt, vt, block_mask=mask, scale=b.scale, enable_gqa=True)  # noqa: E731
        fn()
        rec(
            "torch flex_attention (contiguous K/V, compiled)",
            time_us(fn, False),
            compile_s=round(time.time() - t0, 1),
        )
    except Exception as e:  # noqa: BLE001
        record(case="note", impl="flex_attention", error=repr(e)[:300])


def bench_mixed(copy_gbps: float) -> None:
    """A nano-bench-like mixed step: one 2048-token prefill chunk plus 255 decodes (ctx ~1100)."""
    name = "mixed 1x2048 prefill + 255 decode"
    log(name)
    dec = [int(x) for x in torch.randint(1000, 1201, (255,)).tolist()]
    b = Batch([2048] + dec, [2048] + [1] * 255, sets=ROTATE)

    def rec(impl: str, us: float, **extra) -> None:
        record(case=name, impl=impl, us=round(us, 1), **extra)

    timed(rec, "triton backend.forward: store+split-kv+unified (graph)", b.fn("forward"), True)
    for kw in (dict(), dict(block_m=16)):
        timed(rec, f"triton unified alone, all reqs, {_kw(kw)} (graph)", b.fn("unified", **kw), True)
    d = Batch(dec, [1] * 255, sets=ROTATE)
    timed(rec, "reference: the 255 decodes alone, split-kv (graph)", d.fn("decode"), True)
    p = Batch([2048], [2048], sets=ROTATE)
    timed(rec, "reference: the prefill alone, unified (graph)", p.fn("unified"), True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="default configs only")
    ap.add_argument("--no-flex", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    info = dict(
        device=props.name,
        sms=props.multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        date=datetime.date.today().isoformat(),
        dtype=str(DTYPE),
        shapes=QWEN3_06B,
    )
    info["varlen_attn_params"] = sorted(_varlen()[1])  # has it block_table (paging) / enable_gqa?
    log(json.dumps(info))
    copy_gbps = copy_bandwidth_gbps()
    info["copy_gbps"] = round(copy_gbps, 1)
    log(f"copy bandwidth (read+write): {copy_gbps:.0f} GB/s")
    for section in (
        lambda: bench_decode(copy_gbps, args.quick),
        lambda: bench_mixed(copy_gbps),
        lambda: bench_prefill(args.quick, not args.no_flex),
    ):
        try:
            section()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            record(case="error", impl="section failed", error=traceback.format_exc()[-800:])
    if args.out:
        Path(args.out).write_text(json.dumps(dict(info=info, rows=ROWS), indent=1))
    log(f"\n{info['device']}  copy {copy_gbps:.0f} GB/s  (us: median; GB/s: KV bytes read / time)")
    log(f"{'case':34s} {'impl':48s} {'us':>8s} {'GB/s':>6s} {'%cp':>4s} {'TF/s':>5s}")
    for r in ROWS:
        head = f"{r['case'][:34]:34s} {r['impl'][:48]:48s}"
        if "us" not in r:
            log(f"{head} ERROR {r.get('error', '')[:90]}")
            continue
        frac = f"{100 * r['frac_copy']:.0f}" if "frac_copy" in r else ""
        log(f"{head} {r['us']:8.1f} {r.get('gbps', ''):>6} {frac:>4s} {r.get('tflops', ''):>5}")


if __name__ == "__main__":
    main()
