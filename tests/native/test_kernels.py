"""The native CPU kernels: their build (cache, failure) and the row-wise ops against the torch
reference layers. The decode attention kernel is tested in tests/attention/test_cpu_backend.py."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import apply_rotary
from pagedllm.native import kernels as native

needs_kernels = pytest.mark.skipif(native.load() is None, reason="no C compiler to build the CPU kernels")


def _reference_rms_norm(x, weight, eps, residual=None):
    """norm.py's torch path, spelled out (the module itself now takes the native path)."""
    if residual is not None:
        x = x + residual
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)), x


@needs_kernels
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 rows: the threaded path
@pytest.mark.parametrize("dim", [64, 576, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(rows, dim, with_residual):
    gen = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim + 8, generator=gen)[:, 4 : 4 + dim]  # strided rows
    weight = torch.randn(dim, generator=gen)
    residual = torch.randn(rows, dim, generator=gen) if with_residual else None
    got = native.rms_norm(x, weight, 1e-5, residual)
    ref, ref_sum = _reference_rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        got, got_sum = got
        assert torch.equal(got_sum, ref_sum)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_rms_norm_module_takes_the_native_path_on_cpu_float32():
    norm = RMSNorm(32, eps=1e-6)
    norm.weight.data.normal_()
    x, res = torch.randn(5, 32), torch.randn(5, 32)
    out, new_res = norm(x, res)
    ref, ref_res = _reference_rms_norm(x, norm.weight.detach(), 1e-6, res)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(new_res, ref_res)
    # bf16 (or 3-D per-head norms) keep the torch path: exactly the reference there
    xb = x.bfloat16()
    assert torch.equal(RMSNorm(32).bfloat16()(xb), RMSNorm(32).bfloat16()._norm(xb))


@needs_kernels
@pytest.mark.parametrize("rows,inter", [(1, 8), (40, 1536), (64, 4096)])
def test_silu_and_mul_matches_reference(rows, inter):
    x = torch.randn(rows, 2 * inter) * 6  # wide range: both branches of the stable sigmoid
    x[0, :4] = torch.tensor([-200.0, -88.0, 0.0, 90.0])
    ref = F.silu(x[:, :inter]) * x[:, inter:]
    torch.testing.assert_close(native.silu_and_mul(x), ref, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(SiluAndMul()(x), ref, rtol=2e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (64, 32)])
def test_rotary_embedding_matches_reference(head_dim, rotary_dim):
    gen = torch.Generator().manual_seed(head_dim + rotary_dim)
    tokens, heads = 13, 6
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=gen)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided, as split from qkv
    positions = torch.randint(0, 500, (tokens,), generator=gen)
    cos = torch.randn(512, rotary_dim // 2, generator=gen)
    sin = torch.randn(512, rotary_dim // 2, generator=gen)
    got = native.rotary_embedding(q, positions, cos, sin)
    torch.testing.assert_close(got, apply_rotary(q, cos[positions], sin[positions]), rtol=1e-6, atol=1e-6)
    assert got.is_contiguous() and torch.equal(got[..., rotary_dim:], q[..., rotary_dim:])


@needs_kernels
def test_rotary_embedding_refuses_positions_outside_the_tables():
    x, cos = torch.randn(2, 1, 8), torch.randn(16, 4)
    for bad in ([0, 16], [-1, 3]):
        with pytest.raises(IndexError, match="positions must lie in"):
            native.rotary_embedding(x, torch.tensor(bad), cos, cos)


def test_applies_only_to_cpu_float32_with_unit_stride():
    x = torch.randn(4, 8)
    assert native.applies(x) == (native.load() is not None)
    assert not native.applies(x.double())
    assert not native.applies(x.t())


def test_build_failure_warns_and_returns_none(monkeypatch, tmp_path, caplog):
    """A compiler that fails (here: `false`) leaves the torch path, with the reason logged once."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    native.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="pagedllm.native.kernels"):
            assert native.load() is None
        assert "building the CPU kernels failed" in caplog.text
        assert not list((tmp_path / "cpu_kernels").iterdir())  # no half-written library left behind
        monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
        native.load.cache_clear()
        assert native.load() is None
    finally:
        native.load.cache_clear()


@needs_kernels
def test_build_is_cached_per_source_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    native.load.cache_clear()
    try:
        assert native.load() is not None
        built = list((tmp_path / "cpu_kernels").iterdir())
        assert len(built) == 1 and built[0].suffix == ".so"
        mtime = built[0].stat().st_mtime_ns
        native.load.cache_clear()
        assert native.load() is not None
        assert built[0].stat().st_mtime_ns == mtime  # reused, not rebuilt
    finally:
        native.load.cache_clear()


@needs_kernels
def test_store_kv_cache_equals_the_torch_store():
    """Strided tokens (k and v split from one projection), a padding slot (-1) skipped."""
    from pagedllm.attention.torch_ref import store_kv_cache as torch_store

    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(4, 3 * 2 * 8, generator=gen)
    k, v = qkv[:, 16:32].view(4, 2, 8), qkv[:, 32:].view(4, 2, 8)
    slots = torch.tensor([5, -1, 0, 23])
    cache, ref = torch.zeros(2, 3, 8, 2, 8), torch.zeros(2, 3, 8, 2, 8)
    native.store_kv_cache(k, v, cache, slots)
    torch_store(k, v, ref, slots)
    assert torch.equal(cache, ref) and cache[0, 0, 5].equal(k[0]) and cache[1, 2, 7].equal(v[3])


@needs_kernels
def test_store_kv_cache_refuses_bad_slots_and_shapes():
    k, cache = torch.randn(2, 2, 8), torch.zeros(2, 3, 8, 2, 8)
    with pytest.raises(IndexError, match="slots must lie below 24"):
        native.store_kv_cache(k, k, cache, torch.tensor([0, 24]))
    with pytest.raises(ValueError, match="key must be float32"):
        native.store_kv_cache(k[:, :1], k, cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="one slot per token"):
        native.store_kv_cache(k, k, cache, torch.tensor([0]))
