"""The q/k norm + RoPE kernel with the KV store fused in, against the unfused kernel + the torch store.

GPU tests (marked ``gpu``): on CUDA, or on the CPU under ``TRITON_INTERPRET=1`` (see
tests/layers/test_triton_ops.py for the conventions). The cache starts NaN-poisoned: every slot
written must equal the reference, every other slot (padding tokens, slot -1) must stay NaN.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from pagedllm.attention.torch_ref import store_kv_cache

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (HAS_TRITON and (HAS_CUDA or INTERPRET)), reason="needs Triton and CUDA (or TRITON_INTERPRET=1)"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("heads", [(16, 8, 128), (6, 2, 64)])
def test_fused_store_writes_rotated_k_and_v_to_their_slots(dtype, with_norm, heads):
    from pagedllm.layers.kernels.rotary import qk_norm_rope

    num_q, num_kv, head_dim = heads
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    tokens, block_size, num_blocks = 7, 16, 5
    qkv = torch.randn(tokens, (num_q + 2 * num_kv) * head_dim, generator=gen, device=DEVICE).to(dtype)
    q, k, v = qkv.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
    q = q.view(tokens, num_q, head_dim)
    k = k.view(tokens, num_kv, head_dim)
    v = v.view(tokens, num_kv, head_dim)
    positions = torch.tensor([0, 5, 17, 3, 40, 2, 9], device=DEVICE)
    freqs = torch.arange(64, device=DEVICE).float()[:, None] * (1e4 ** (-torch.arange(0, head_dim, 2, device=DEVICE) / head_dim))[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    norms = None
    if with_norm:
        w = (1 + 0.1 * torch.randn(2, head_dim, generator=gen, device=DEVICE)).to(dtype)
        norms = ((w[0], 1e-6), (w[1], 1e-6))
    # Slots: scattered over blocks; the last token is a padding token (slot -1).
    slots = torch.tensor([3, 70, 16, 45, 0, 33, -1], dtype=torch.int64, device=DEVICE)

    q_ref, k_ref = qk_norm_rope(positions, q, k, cos, sin, *(norms or (None, None)))
    cache_ref = torch.full((2, num_blocks, block_size, num_kv, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    store_kv_cache(k_ref, v.contiguous(), cache_ref, slots)

    cache = torch.full_like(cache_ref, float("nan"))
    q_out, k_out = qk_norm_rope(positions, q, k, cos, sin, *(norms or (None, None)), kv_store=(v, cache, slots))
    assert k_out is None
    assert torch.equal(q_out, q_ref)
    assert torch.equal(cache.isnan(), cache_ref.isnan())  # nothing else was written
    written = ~cache_ref.isnan()
    assert torch.equal(cache[written], cache_ref[written])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("hidden", [64, 200])
def test_row_scale_equals_scaling_first(dtype, with_norm, hidden):
    """``row_scale=(s, eps)`` (the residual-stream forward): q, k and the stored v are scaled by each
    token's 1 / rms(s) first; the same as ``norm.rms_scale`` on the projection output, then the
    kernel without a scale (with and without the KV store)."""
    from pagedllm.layers.kernels.rotary import qk_norm_rope
    from pagedllm.layers.norm import rms_scale

    num_q, num_kv, head_dim = 6, 2, 64
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    tokens, block_size, num_blocks = 5, 16, 4
    qkv = torch.randn(tokens, (num_q + 2 * num_kv) * head_dim, generator=gen, device=DEVICE).to(dtype)
    s = (3 * torch.randn(tokens, hidden + 8, generator=gen, device=DEVICE)).to(dtype)[:, 8:]  # strided rows
    positions = torch.tensor([0, 5, 17, 3, 40], device=DEVICE)
    freqs = torch.arange(64, device=DEVICE).float()[:, None] * (1e4 ** (-torch.arange(0, head_dim, 2, device=DEVICE) / head_dim))[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    norms = (None, None)
    if with_norm:
        w = (1 + 0.1 * torch.randn(2, head_dim, generator=gen, device=DEVICE)).to(dtype)
        norms = ((w[0], 1e-6), (w[1], 1e-6))
    slots = torch.tensor([3, 40, 16, -1, 33], dtype=torch.int64, device=DEVICE)

    def split(x):
        q, k, v = x.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
        return q.view(tokens, num_q, head_dim), k.view(tokens, num_kv, head_dim), v.view(tokens, num_kv, head_dim)

    q_ref, k_ref = qk_norm_rope(positions, *split(rms_scale(qkv, s, 1e-5))[:2], cos, sin, *norms)
    v_ref = split(rms_scale(qkv, s, 1e-5))[2]
    q, k, v = split(qkv)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    q_out, k_out = qk_norm_rope(positions, q, k, cos, sin, *norms, row_scale=(s, 1e-5))
    torch.testing.assert_close(q_out, q_ref, **tol)
    torch.testing.assert_close(k_out, k_ref, **tol)
    cache = torch.full((2, num_blocks, block_size, num_kv, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    q_out, _ = qk_norm_rope(positions, q, k, cos, sin, *norms, kv_store=(v, cache, slots), row_scale=(s, 1e-5))
    torch.testing.assert_close(q_out, q_ref, **tol)
    flat = cache.view(2, num_blocks * block_size, num_kv, head_dim)
    kept = slots >= 0
    torch.testing.assert_close(flat[0, slots[kept]], k_ref[kept], **tol)
    torch.testing.assert_close(flat[1, slots[kept]], v_ref[kept], **tol)
    assert int((~flat.isnan()).sum()) == 2 * int(kept.sum()) * num_kv * head_dim  # nothing else written
