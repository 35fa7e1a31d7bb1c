"""The native CPU decode kernel and the CPU backend, against the torch reference."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.cpu_backend import SHORT_QUERY_LEN, CpuBackend, DecodeRows
from pagedllm.attention.registry import get_attention_backend
from pagedllm.attention.torch_ref import TorchRefBackend
from pagedllm.native import kernels as cpu_kernels
from tests.attention.test_triton_backend import attend, make_inputs, random_specs

needs_kernel = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler to build the CPU kernels")


@needs_kernel
@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("num_reqs", [1, 2, 37])
@pytest.mark.parametrize("block_size,num_kv_heads,qpk,head_dim", [
    (16, 3, 3, 64),    # SmolLM2's shape: GQA 3 query heads per KV head
    (1, 2, 1, 128),    # one token per block, multi-head
    (8, 4, 2, 32),     # a head size with no specialised code
    (32, 1, 8, 64),    # one KV head (MQA)
])
def test_backend_matches_reference(kind, num_reqs, block_size, num_kv_heads, qpk, head_dim):
    """Shuffled pages, lengths from 1 to several blocks, padding tokens, decodes mixed with full and
    chunked prefills in one step; the reference uses the same stored cache."""
    gen = torch.Generator().manual_seed(num_reqs * 1000 + head_dim + block_size)
    specs = random_specs(gen, kind, num_reqs, max_seq=300)
    q, k, v, cache, meta = make_inputs(specs, block_size=block_size, num_kv_heads=num_kv_heads, qpk=qpk,
                                       head_dim=head_dim, dtype=torch.float32, device="cpu", gen=gen)
    ref_cache = cache.clone()
    out = attend(CpuBackend(), q, k, v, cache, meta, head_dim ** -0.5)
    ref = attend(TorchRefBackend(), q, k, v, ref_cache, meta, head_dim ** -0.5)
    assert torch.equal(cache, ref_cache)
    n = meta.num_actual_tokens
    torch.testing.assert_close(out[:n], ref[:n], rtol=2e-5, atol=2e-5)
    assert not out[n:].any()


@needs_kernel
def test_kernel_writes_only_the_listed_rows():
    gen = torch.Generator().manual_seed(3)
    q, k, v, cache, meta = make_inputs([(40, 1), (7, 1), (90, 1)], block_size=16, num_kv_heads=2, qpk=2,
                                       head_dim=64, dtype=torch.float32, device="cpu", gen=gen, num_pad_tokens=0)
    out = torch.full_like(q, 7.0)
    cpu_kernels.paged_decode_attention(q, cache, out, meta.block_tables, torch.tensor([2, 0]), torch.tensor([2, 0]),
                                       torch.tensor([90, 40]), 0.125)
    assert bool((out[1] == 7.0).all()) and not bool((out[[0, 2]] == 7.0).any())


@needs_kernel
@pytest.mark.parametrize("field,change,message", [
    ("query", lambda a: a.update(query=a["query"].double()), "query must be a CPU torch.float32"),
    ("kv_cache", lambda a: a.update(kv_cache=a["kv_cache"].bfloat16()), "kv_cache must be a CPU float32 or float8"),
    ("seq_lens", lambda a: a.update(seq_lens=a["seq_lens"].int()), "seq_lens must be a CPU torch.int64"),
    ("table_rows", lambda a: a.update(table_rows=a["table_rows"][:1]), "one entry per decode request"),
    ("query", lambda a: a.update(query=a["query"][:, :3]), "must be contiguous"),
    ("query", lambda a: a.update(query=a["query"][:, :3].contiguous(), out=a["out"][:, :3].contiguous()),
     "do not fit the cache"),
])
def test_kernel_rejects_bad_inputs(field, change, message):
    gen = torch.Generator().manual_seed(4)
    q, k, v, cache, meta = make_inputs([(20, 1), (9, 1)], block_size=4, num_kv_heads=2, qpk=2, head_dim=16,
                                       dtype=torch.float32, device="cpu", gen=gen, num_pad_tokens=0)
    args = dict(query=q, kv_cache=cache, out=torch.zeros_like(q), block_tables=meta.block_tables,
                query_rows=torch.tensor([0, 1]), table_rows=torch.tensor([0, 1]), seq_lens=torch.tensor([20, 9]),
                scale=0.25)
    change(args)
    with pytest.raises(ValueError, match=message):
        cpu_kernels.paged_decode_attention(**args)


def test_decode_rows_list_every_query_of_short_requests():
    """Decodes and short queries (verification of drafts) become single-query rows, each over the
    keys up to its own position; a long query (prefill) is left to the reference."""
    gen = torch.Generator().manual_seed(5)
    *_, meta = make_inputs([(30, 30), (12, 1), (50, 3), (3, 1)], block_size=4, num_kv_heads=1, qpk=1, head_dim=8,
                           dtype=torch.float32, device="cpu", gen=gen)
    rows = DecodeRows(CpuBackend.metadata_builder.build(meta))
    assert rows.query_rows.tolist() == [30, 31, 32, 33, 34] and rows.table_rows.tolist() == [1, 2, 2, 2, 3]
    assert rows.seq_lens.tolist() == [12, 48, 49, 50, 3] and rows.num_decodes == 5 and rows.has_prefill


@needs_kernel
@pytest.mark.parametrize("query_len", [2, 4, SHORT_QUERY_LEN])
def test_short_queries_match_the_reference(query_len):
    """A verification-shaped step (every request 1 + k queries after a long context) in the decode
    kernel gives the reference's outputs."""
    gen = torch.Generator().manual_seed(query_len)
    specs = [(seq, query_len) for seq in (query_len, 40, 173, 300)]
    q, k, v, cache, meta = make_inputs(specs, block_size=16, num_kv_heads=3, qpk=3, head_dim=64,
                                       dtype=torch.float32, device="cpu", gen=gen)
    ref_cache = cache.clone()
    backend = CpuBackend()
    out = attend(backend, q, k, v, cache, meta, 0.125)
    assert backend._rows.num_decodes == 4 * query_len and not backend._rows.has_prefill
    n = meta.num_actual_tokens
    torch.testing.assert_close(out[:n], attend(TorchRefBackend(), q, k, v, ref_cache, meta, 0.125)[:n],
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_falls_back_to_the_reference(monkeypatch, dtype):
    """No kernel (disabled here), or a cache dtype the kernel does not take: the reference answers."""
    if dtype == torch.float32:
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    gen = torch.Generator().manual_seed(6)
    q, k, v, cache, meta = make_inputs([(33, 1), (20, 20)], block_size=16, num_kv_heads=2, qpk=2, head_dim=64,
                                       dtype=dtype, device="cpu", gen=gen)
    ref_cache = cache.clone()
    out = attend(CpuBackend(), q, k, v, cache, meta, 0.125)
    assert torch.equal(out, attend(TorchRefBackend(), q, k, v, ref_cache, meta, 0.125))


def test_auto_backend_on_cpu_is_the_cpu_backend():
    assert get_attention_backend("auto", torch.device("cpu")).name == "cpu"
    assert get_attention_backend("torch_ref", torch.device("cpu")).name == "torch_ref"


@pytest.mark.parametrize("window,soft_cap", [(7, None), (None, 3.0), (20, 3.0)])
def test_sliding_window_and_soft_cap_layers_take_the_reference(window, soft_cap):
    """The native kernel attends over the whole context with plain scores: a layer with a window or
    a soft cap must get the reference's answer (which the torch_ref tests check against naive)."""
    gen = torch.Generator().manual_seed(5)
    specs = [(40, 1), (70, 1), (33, 33), (60, 12)]
    q, k, v, cache, meta = make_inputs(specs, block_size=8, num_kv_heads=2, qpk=2, head_dim=32,
                                       dtype=torch.float32, device="cpu", gen=gen)
    options = {"sliding_window": window, "logits_soft_cap": soft_cap}
    ref_cache = cache.clone()
    out = attend(CpuBackend(), q, k, v, cache, meta, 0.2, **options)
    ref = attend(TorchRefBackend(), q, k, v, ref_cache, meta, 0.2, **options)
    plain = attend(TorchRefBackend(), q, k, v, ref_cache.clone(), meta, 0.2)
    n = meta.num_actual_tokens
    torch.testing.assert_close(out[:n], ref[:n], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out[:n], plain[:n], atol=1e-3)  # the options change the answer


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_request_splits_its_kv_groups_over_the_threads(threads):
    """One decode request with 3 KV heads: 3 items of one KV group each on 2 threads (or 1 item on 1);
    the result is the same whichever thread attends which group."""
    gen = torch.Generator().manual_seed(6)
    q, k, v, cache, meta = make_inputs([(170, 1)], block_size=16, num_kv_heads=3, qpk=3, head_dim=64,
                                       dtype=torch.float32, device="cpu", gen=gen, num_pad_tokens=0)
    ref = attend(TorchRefBackend(), q, k, v, cache.clone(), meta, 0.125)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = attend(CpuBackend(), q, k, v, cache, meta, 0.125)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
