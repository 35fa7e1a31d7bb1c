"""The split-KV kernel for short queries (``triton_kernels/short_query_attention.py``, speculative
verification) against the torch reference: directly with several split counts, and through
``TritonBackend`` (which routes batches of short queries to it). CPU: Triton's interpreter in a
subprocess (seconds); GPU (``-m gpu``): larger contexts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedllm.attention.torch_ref import TorchRefBackend
from tests.attention.test_triton_backend import TOL, attend, check_against_ref, make_inputs, rel_err

# (seq_len, query_len): verify-like requests (1 + k queries over a context), decodes and a
# request whose queries are its whole sequence.
SPECS = [(200, 6), (37, 1), (9, 6), (6, 6), (130, 3), (70, 2)]


def test_fits_bounds_the_query_tile():
    pytest.importorskip("triton")
    from pagedllm.attention.triton_kernels.short_query_attention import MAX_ROWS, fits

    assert fits(6, 3) and fits(16, 4) and fits(8, 8)
    assert not fits(9, 8) and not fits(MAX_ROWS + 1, 1)


def _check_direct(specs, block_size, qpk, head_dim, dtype, device, gen, splits=(1, 2, 8), **window) -> None:
    from pagedllm.attention.triton_kernels.short_query_attention import short_query_attention

    query, key, value, kv_cache, meta = make_inputs(specs, block_size=block_size, num_kv_heads=2, qpk=qpk,
                                                    head_dim=head_dim, dtype=dtype, device=device, gen=gen)
    ref = attend(TorchRefBackend(), query, key, value, kv_cache, meta, 0.125, **window)  # stores the KV
    starts = meta.query_start_loc.tolist()
    rows = [t for r, (_, q) in enumerate(specs) if q > 1 for t in range(starts[r], starts[r] + q)]
    others = [t for t in range(query.shape[0]) if t not in rows]
    for num_splits in splits:
        out = torch.full_like(query, float("nan"))
        short_query_attention(out, query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                              meta.max_query_len, 0.125, num_splits=num_splits, **window)
        err = rel_err(out[rows], ref[rows])
        print("short", block_size, qpk, head_dim, dtype, "splits", num_splits, window, err)
        assert err < TOL[dtype], err
        assert torch.isnan(out[others]).all(), "decode and padding rows are left alone"


def _interpreter_main() -> None:
    from tests.attention.test_triton_backend import _patch_interpreter_scalar_index

    _patch_interpreter_scalar_index()
    gen = torch.Generator().manual_seed(0)
    for block_size, qpk, head_dim, dtype in ((16, 3, 64, torch.float32), (32, 2, 80, torch.float16)):
        _check_direct(SPECS, block_size, qpk, head_dim, dtype, "cpu", gen)
        inputs = make_inputs(SPECS, block_size=block_size, num_kv_heads=2, qpk=qpk, head_dim=head_dim,
                             dtype=dtype, device="cpu", gen=gen)
        print("backend", check_against_ref(*inputs, 0.125, dtype))
    _check_direct(SPECS, 16, 2, 64, torch.float32, "cpu", gen, splits=(1, 4), sliding_window=24)


@pytest.mark.slow
def test_short_query_kernel_in_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    code = f"import runpy; runpy.run_path({__file__!r})['_interpreter_main']()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qpk", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_short_query_kernel_on_cuda(qpk, dtype):
    gen = torch.Generator().manual_seed(qpk)
    q = min(8, 64 // triton_next_pow2(qpk))
    specs = [(5000, q), (1, 1), (1033, q), (q, q), (300, 2), (4097, 1)]
    _check_direct(specs, 16, qpk, 128, dtype, "cuda", gen, splits=(1, 3, 64))
    _check_direct(specs, 16, qpk, 128, dtype, "cuda", gen, splits=(4,), sliding_window=700)
    inputs = make_inputs(specs, block_size=16, num_kv_heads=2, qpk=qpk, head_dim=128, dtype=dtype, device="cuda",
                         gen=gen)
    check_against_ref(*inputs, 0.125, dtype)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
