"""TritonBackend against the torch reference on random ragged batches.

GPU tests (``-m gpu``) skip without CUDA. The CPU tests check that the backend module imports
without a GPU (and without Triton), and, where Triton is installed, run the kernels in Triton's
interpreter (``TRITON_INTERPRET=1``, fp16/fp32 only) on a small batch.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

from pagedllm.attention.backend import AttentionBackend, CommonAttentionInputs
from pagedllm.attention.torch_ref import TorchRefBackend

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# ---------------------------------------------------------------------------------------------
# Random ragged batches
# ---------------------------------------------------------------------------------------------


def random_specs(gen: torch.Generator, kind: str, num_reqs: int, max_seq: int) -> list[tuple[int, int]]:
    """(seq_len, query_len) per request. ``kind``: "decode", or "mixed" (decode, full prefill and
    chunked prefill over a cached prefix, shuffled)."""

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    specs = []
    for i in range(num_reqs):
        what = "decode" if kind == "decode" else ("decode", "prefill", "chunked")[i % 3]
        if what == "decode":
            specs.append((randint(1, max_seq), 1))
        elif what == "prefill":
            n = randint(2, min(max_seq, 1100))
            specs.append((n, n))
        else:
            seq = randint(2, max_seq)
            specs.append((seq, randint(2, min(seq, 600))))
    order = torch.randperm(len(specs), generator=gen).tolist()
    return [specs[i] for i in order]


def make_inputs(specs, *, block_size, num_kv_heads, qpk, head_dim, dtype, device, gen, num_pad_tokens=3):
    """Query/key/value, a random cache and metadata for ``specs``; each request's blocks are a
    random (shuffled, non-contiguous) subset of the cache; unused table entries point at random
    blocks; ``num_pad_tokens`` trailing padding tokens have slot -1."""
    num_heads = num_kv_heads * qpk
    blocks_per_req = [math.ceil(s / block_size) for s, _ in specs]
    max_blocks = max(blocks_per_req)
    num_blocks = sum(blocks_per_req) + 7
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(specs), max_blocks), generator=gen, dtype=torch.int32)
    used = 0
    for r, nb in enumerate(blocks_per_req):
        tables[r, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    slots, qsl = [], [0]
    for r, (seq, qlen) in enumerate(specs):
        for pos in range(seq - qlen, seq):
            slots.append(int(tables[r, pos // block_size]) * block_size + pos % block_size)
        qsl.append(qsl[-1] + qlen)
    n = qsl[-1]
    T = n + num_pad_tokens
    slots += [-1] * num_pad_tokens

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    kv_cache = rnd(2, num_blocks, block_size, num_kv_heads, head_dim).to(device)
    query, key, value = (rnd(T, h, head_dim).to(device) for h in (num_heads, num_kv_heads, num_kv_heads))
    meta = CommonAttentionInputs(
        num_actual_tokens=n,
        max_query_len=max(q for _, q in specs),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s for s, _ in specs], dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_host=np.array(qsl, dtype=np.int32),
        seq_lens_host=np.array([s for s, _ in specs], dtype=np.int32),
    )
    return query, key, value, kv_cache, meta


def attend(backend, query, key, value, kv_cache, common: CommonAttentionInputs, scale, **kw):
    """``backend.forward`` over the metadata its own builder makes of ``common``."""
    return backend.forward(query, key, value, kv_cache, backend.metadata_builder.build(common), scale, **kw)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def split_decode(out, query, kv_cache, meta, scale, **kw):
    """``paged_attention.paged_decode`` straight on the metadata's tensors (no backend), into ``out``."""
    from pagedllm.attention.triton_kernels import paged_attention

    paged_attention.paged_decode(
        out, query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, **kw
    )


def check_against_ref(query, key, value, kv_cache, meta, scale, dtype):
    """Run both backends on copies of the cache; outputs and caches must agree."""
    from pagedllm.attention.triton_backend import TritonBackend

    cache_ref, cache_tri = kv_cache.clone(), kv_cache.clone()
    ref = attend(TorchRefBackend(), query, key, value, cache_ref, meta, scale)
    out = torch.full_like(query, float("nan"))  # poisoned: every row must be written
    got = attend(TritonBackend(), query, key, value, cache_tri, meta, scale, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(cache_tri, cache_ref), "KV cache contents differ after the store"
    assert not torch.isnan(got).any(), "unwritten (poisoned) output elements"
    n = meta.num_actual_tokens
    assert torch.all(got[n:] == 0), "padding rows must come back as zeros"
    err = rel_err(got[:n], ref[:n])
    assert err < TOL[dtype], f"relative error {err:.2e}"
    return err


# ---------------------------------------------------------------------------------------------
# CPU tests (CI)
# ---------------------------------------------------------------------------------------------


def test_module_imports_without_gpu():
    from pagedllm.attention import triton_backend
    from pagedllm.attention.registry import get_attention_backend

    assert triton_backend.TritonBackend.name == "triton"
    assert issubclass(triton_backend.TritonBackend, AttentionBackend)
    if triton_backend.HAS_TRITON:
        assert isinstance(get_attention_backend("triton", torch.device("cpu")), triton_backend.TritonBackend)
    else:
        with pytest.raises(ImportError):
            triton_backend.TritonBackend()
    assert get_attention_backend("auto", torch.device("cpu")).name == "cpu"
    if not torch.cuda.is_available():
        assert not triton_backend.triton_available()


def test_decode_num_splits_depends_only_on_batch_shape():
    pytest.importorskip("triton")
    from pagedllm.attention.triton_kernels.paged_attention import _MAX_SPLITS, decode_num_splits

    assert decode_num_splits(256, 8, 132) == 1
    assert decode_num_splits(1, 8, 132) == _MAX_SPLITS
    for b in range(1, 300):
        s = decode_num_splits(b, 8, 132)
        assert 1 <= s <= _MAX_SPLITS and s & (s - 1) == 0


def _patch_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter keeps scalars as 1-element arrays and turns them into Python ints
    with ``int(array)``, which numpy >= 2.4 refuses (``range(start, tensor_end)`` breaks)."""
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def _interpreter_main() -> None:
    """Small batches through the kernels in Triton's interpreter (run in a subprocess)."""
    _patch_interpreter_scalar_index()

    gen = torch.Generator().manual_seed(0)
    cases = [(16, 2, 64, torch.float16), (32, 1, 80, torch.float32), (16, 4, 64, torch.float32)]
    for block_size, qpk, head_dim, dtype in cases:
        specs = [(37, 1), (70, 70), (90, 20), (5, 1)]
        inputs = make_inputs(
            specs,
            block_size=block_size,
            num_kv_heads=2,
            qpk=qpk,
            head_dim=head_dim,
            dtype=dtype,
            device="cpu",
            gen=gen,
        )
        print("mixed", block_size, qpk, head_dim, dtype, check_against_ref(*inputs, 0.125, dtype))
        specs = [(150, 1), (3, 1), (64, 1)]
        query, key, value, kv_cache, meta = make_inputs(
            specs,
            block_size=block_size,
            num_kv_heads=2,
            qpk=qpk,
            head_dim=head_dim,
            dtype=dtype,
            device="cpu",
            gen=gen,
        )
        check_against_ref(query, key, value, kv_cache, meta, 0.125, dtype)  # 1 split (no SMs to count)
        ref = attend(TorchRefBackend(), query, key, value, kv_cache, meta, 0.125)  # stores into kv_cache
        longest_first = torch.tensor([0, 2, 1], dtype=torch.int32)  # any permutation: same result
        for splits, order in ((1, longest_first), (2, None), (8, None), (2, longest_first)):
            out = torch.full_like(query, float("nan"))
            split_decode(out, query, kv_cache, meta, 0.125, num_splits=splits, order=order)
            n = meta.num_actual_tokens
            err = rel_err(out[:n], ref[:n])
            print("decode splits", splits, "order", order, err)
            assert err < TOL[dtype]


@pytest.mark.slow
def test_kernels_in_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    code = f"import runpy; runpy.run_path({__file__!r})['_interpreter_main']()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


# ---------------------------------------------------------------------------------------------
# GPU tests
# ---------------------------------------------------------------------------------------------

# (block_size, queries per kv head, head_dim, dtype): every supported value at least once.
GPU_CASES = [
    (16, 2, 128, torch.bfloat16),  # Qwen3-0.6B
    (16, 1, 128, torch.bfloat16),
    (32, 4, 64, torch.bfloat16),
    (64, 8, 128, torch.bfloat16),
    (16, 8, 64, torch.float16),
    (32, 1, 64, torch.float16),
    (64, 2, 128, torch.float16),
    (16, 4, 96, torch.bfloat16),
    (32, 2, 80, torch.bfloat16),
    (16, 4, 128, torch.float32),
]


def _case_id(case) -> str:
    bs, qpk, hd, dt = case
    return f"bs{bs}-gqa{qpk}-d{hd}-{str(dt).split('.')[-1]}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "kind,num_reqs,max_seq", [("mixed", 12, 8192), ("decode", 9, 8192), ("decode", 1, 8192)]
)
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_matches_reference(case, kind, num_reqs, max_seq):
    block_size, qpk, head_dim, dtype = case
    gen = torch.Generator().manual_seed(zlib.crc32(f"{_case_id(case)}-{kind}-{num_reqs}".encode()))
    specs = random_specs(gen, kind, num_reqs, max_seq)
    if num_reqs == 1:
        specs = [(max_seq, 1)]
    inputs = make_inputs(
        specs,
        block_size=block_size,
        num_kv_heads=2,
        qpk=qpk,
        head_dim=head_dim,
        dtype=dtype,
        device="cuda",
        gen=gen,
    )
    check_against_ref(*inputs, head_dim**-0.5, dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [1, 2, 8, 64])
def test_decode_split_counts(num_splits):
    """Every split count agrees with the reference, including empty splits (short contexts)."""

    gen = torch.Generator().manual_seed(num_splits)
    specs = [(1, 1), (17, 1), (130, 1), (1000, 1), (4097, 1), (8192, 1)]
    query, key, value, kv_cache, meta = make_inputs(
        specs,
        block_size=16,
        num_kv_heads=8,
        qpk=2,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
        gen=gen,
    )
    ref = attend(TorchRefBackend(), query, key, value, kv_cache, meta, 0.088)
    n = meta.num_actual_tokens
    for _ in range(3):  # launches in a row (each reuses the same partial buffers' sizes)
        out = torch.full_like(query, float("nan"))
        split_decode(out, query, kv_cache, meta, 0.088, num_splits=num_splits)
        assert rel_err(out[:n], ref[:n]) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("order_kind", ["longest_first", "random"])
def test_decode_launch_order(order_kind):
    """A launch order (``TritonMetadata.decode_order``, as the runner stages it from 32 requests) changes
    no result: a ragged batch of 40 decodes plus a prefill, through the backend."""
    gen = torch.Generator().manual_seed(11)
    lens = torch.randint(1, 3000, (40,), generator=gen).tolist()
    specs = [(n, 1) for n in lens] + [(300, 40)]
    query, key, value, kv_cache, meta = make_inputs(
        specs, block_size=16, num_kv_heads=8, qpk=2, head_dim=128, dtype=torch.bfloat16, device="cuda", gen=gen
    )
    seq_lens = torch.tensor([s for s, _ in specs])
    if order_kind == "longest_first":
        order = torch.argsort(-seq_lens, stable=True)
    else:
        order = torch.randperm(len(specs), generator=gen)
    meta.longest_first = order.to(torch.int32).cuda()
    check_against_ref(query, key, value, kv_cache, meta, 0.088, torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
def test_mixed_batch_with_small_tiles():
    """Mixed batches whose longest query is short take 16-row tiles (BLOCK_Q of 2..16 tokens)."""
    gen = torch.Generator().manual_seed(7)
    specs = [(3000, 1), (40, 3), (900, 5), (7, 7), (5000, 1), (64, 2)]
    for qpk in (1, 8):
        inputs = make_inputs(
            specs,
            block_size=32,
            num_kv_heads=2,
            qpk=qpk,
            head_dim=128,
            dtype=torch.bfloat16,
            device="cuda",
            gen=gen,
        )
        check_against_ref(*inputs, 0.1, torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
def test_decode_cuda_graph_replay():
    """Capture the decode path once; replay with new sequence lengths, tables and queries written
    in place into the captured tensors; padded requests (seq_len 0) come back as zeros."""
    from pagedllm.attention.triton_backend import TritonBackend

    gen = torch.Generator().manual_seed(3)
    batch, padded, bs, hkv, qpk, hd = 5, 8, 16, 8, 2, 128
    max_blocks = 8192 // bs
    num_blocks = padded * max_blocks
    kv_cache = torch.randn(2, num_blocks, bs, hkv, hd, generator=gen).to(torch.bfloat16).cuda()
    query = torch.zeros(padded, hkv * qpk, hd, dtype=torch.bfloat16, device="cuda")
    key = torch.zeros(padded, hkv, hd, dtype=torch.bfloat16, device="cuda")
    value = torch.zeros_like(key)
    meta = CommonAttentionInputs(
        num_actual_tokens=padded,
        max_query_len=1,
        query_start_loc=torch.arange(padded + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.zeros(padded, dtype=torch.int32, device="cuda"),
        block_tables=torch.zeros(padded, max_blocks, dtype=torch.int32, device="cuda"),
        slot_mapping=torch.full((padded,), -1, dtype=torch.int64, device="cuda"),
    )
    out = torch.zeros_like(query)
    backend = TritonBackend()

    def step():
        attend(backend, query, key, value, kv_cache, meta, hd**-0.5, out=out)

    meta.seq_lens.fill_(1)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for trial in range(2):
        specs = random_specs(gen, "decode", batch, 8192)
        q, k, v, _, m = make_inputs(
            specs,
            block_size=bs,
            num_kv_heads=hkv,
            qpk=qpk,
            head_dim=hd,
            dtype=torch.bfloat16,
            device="cuda",
            gen=gen,
            num_pad_tokens=0,
        )
        tables = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].view(batch, max_blocks)
        m.block_tables = tables.to(torch.int32).cuda()
        m.slot_mapping = torch.tensor(
            [int(m.block_tables[r, (s - 1) // bs]) * bs + (s - 1) % bs for r, (s, _) in enumerate(specs)],
            device="cuda",
        )
        ref_cache = kv_cache.clone()
        ref = attend(TorchRefBackend(), q, k, v, ref_cache, m, hd**-0.5)
        query[:batch], key[:batch], value[:batch] = q, k, v
        meta.seq_lens.zero_()
        meta.seq_lens[:batch] = m.seq_lens
        meta.block_tables[:batch] = m.block_tables
        meta.slot_mapping.fill_(-1)
        meta.slot_mapping[:batch] = m.slot_mapping
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(kv_cache, ref_cache), f"trial {trial}: cache differs"
        assert rel_err(out[:batch], ref) < 1e-2, f"trial {trial}"
        assert torch.all(out[batch:] == 0), "padded requests (seq_len 0) must give zeros"
