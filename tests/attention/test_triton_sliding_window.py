"""The Triton kernels' sliding window and logit soft cap against the torch reference.

CPU (CI): tiny batches in Triton's interpreter (``TRITON_INTERPRET=1``, a subprocess), seconds.
GPU (``-m gpu``): realistic shapes. In both, the blocks wholly before every query's window (a
sliding model may have given them back to the pool) are replaced by blocks of NaN that nothing
else points at: a kernel that loads any of them returns NaN.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedllm.attention.torch_ref import TorchRefBackend
from tests.attention.test_triton_backend import TOL, attend, make_inputs, rel_err

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def poison_blocks_outside_windows(specs, kv_cache, common, window):
    """Point every block-table entry wholly before its request's first visible key at a fresh NaN
    block; returns the grown cache."""
    block_size = kv_cache.shape[2]
    gone = [(r, b) for r, (seq, q_len) in enumerate(specs) for b in range(max(0, seq - q_len - window + 1) // block_size)]
    if not gone:
        return kv_cache
    poison = torch.full((2, len(gone), *kv_cache.shape[2:]), float("nan"), dtype=kv_cache.dtype, device=kv_cache.device)
    for i, (r, b) in enumerate(gone):
        common.block_tables[r, b] = kv_cache.shape[1] + i
    return torch.cat([kv_cache, poison], dim=1)


def check_window(specs, *, window, soft_cap, block_size, qpk, head_dim, dtype, device, seed, num_splits=None):
    """Backend forward (and the split decode at ``num_splits``) against the reference."""
    from pagedllm.attention.triton_backend import TritonBackend
    from pagedllm.attention.triton_kernels import paged_attention

    gen = torch.Generator().manual_seed(seed)
    query, key, value, kv_cache, common = make_inputs(
        specs, block_size=block_size, num_kv_heads=2, qpk=qpk, head_dim=head_dim, dtype=dtype, device=device, gen=gen
    )
    if window is not None:
        kv_cache = poison_blocks_outside_windows(specs, kv_cache, common, window)
    options = {"sliding_window": window, "logits_soft_cap": soft_cap}
    cache_ref, cache_tri = kv_cache.clone(), kv_cache.clone()
    ref = attend(TorchRefBackend(), query, key, value, cache_ref, common, 0.3, **options)
    out = torch.full_like(query, float("nan"))
    got = attend(TritonBackend(), query, key, value, cache_tri, common, 0.3, out=out, **options)
    n = common.num_actual_tokens
    assert not torch.isnan(got[:n]).any(), "NaN: a key outside the window was read, or a row was not written"
    err = rel_err(got[:n], ref[:n])
    assert err < TOL[dtype], f"relative error {err:.2e}"
    if num_splits is not None:
        decodes = [r for r, (_, q_len) in enumerate(specs) if q_len == 1]
        rows = common.query_start_loc[torch.tensor(decodes, device=device)].long()
        split = torch.full_like(query, float("nan"))
        paged_attention.paged_decode(split, query, cache_tri, common.block_tables, common.seq_lens,
                                     common.query_start_loc, 0.3, num_splits=num_splits, **options)
        err = rel_err(split[rows], ref[rows])
        assert err < TOL[dtype], f"split decode ({num_splits}): relative error {err:.2e}"
    return err


# Decodes past / inside the window, prefills and chunks longer than the window, a chunk whose
# first query sees less than one tile.
INTERPRETER_SPECS = [(37, 1), (70, 70), (90, 20), (5, 1), (41, 2), (66, 1)]
INTERPRETER_CASES = [  # (window, soft_cap, block_size, qpk, head_dim, dtype)
    (8, None, 16, 2, 64, torch.float32),
    (19, 3.0, 16, 1, 32, torch.float32),
    (1, None, 32, 4, 32, torch.float32),
    (None, 2.0, 16, 2, 64, torch.float16),
    (40, 30.0, 16, 2, 64, torch.float16),
]


def _interpreter_main() -> None:
    from tests.attention.test_triton_backend import _patch_interpreter_scalar_index

    _patch_interpreter_scalar_index()
    for i, (window, cap, block_size, qpk, head_dim, dtype) in enumerate(INTERPRETER_CASES):
        err = check_window(INTERPRETER_SPECS, window=window, soft_cap=cap, block_size=block_size, qpk=qpk,
                           head_dim=head_dim, dtype=dtype, device="cpu", seed=i, num_splits=2 + i % 2 * 2)
        print("ok", window, cap, block_size, qpk, head_dim, dtype, err)


@pytest.mark.slow
def test_sliding_window_and_soft_cap_in_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    code = f"import runpy, sys; sys.path.insert(0, {os.getcwd()!r}); runpy.run_path({__file__!r})['_interpreter_main']()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("ok") == len(INTERPRETER_CASES), proc.stdout


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("window,soft_cap", [(4096, None), (512, None), (1024, 50.0), (None, 50.0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sliding_window_matches_reference_on_gpu(window, soft_cap, dtype):
    """Mistral's and Gemma 2's options at realistic lengths: long decodes, prefills and chunks."""
    specs = [(8192, 1), (300, 1), (5000, 1), (2048, 2048), (6000, 900), (4097, 1), (700, 64)]
    for splits in (1, 4, 64):
        check_window(specs, window=window, soft_cap=soft_cap, block_size=16, qpk=4, head_dim=128, dtype=dtype,
                     device="cuda", seed=splits, num_splits=splits)
