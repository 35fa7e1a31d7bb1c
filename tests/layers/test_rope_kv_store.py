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
