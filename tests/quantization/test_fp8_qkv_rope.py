"""The one-launch residual add + RMSNorm + FP8 qkv GEMV + RoPE + K/V store of a batch-1 decode
(pagedllm/quantization/kernels/fp8_qkv_rope.py) against the torch ops one after the other (the
dequantized weight, NeoX RoPE with torch's roundings, the cache store with its float8 clamp): under
Triton's interpreter in CI and on CUDA (``gpu``); and the layer routing ``forward_norm_rope_store``
to the FP8 method."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from pagedllm.quantization import fp8, fp8_ops

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs Triton and CUDA")


def reference(x, residual, g, eps, wq, w_scale, bias, pos, cos_cache, sin_cache, hq, hkv, kv_cache, slot):
    """The unfused ops in torch: ``(q rotated, new residual)``; k and v stored into ``kv_cache``."""
    dtype = x.dtype
    s = x if residual is None else (x.float() + residual.float()).to(dtype)
    normed = s.double() * torch.rsqrt(s.double().pow(2).mean(-1, keepdim=True) + eps) * g.double()
    y = normed @ fp8_ops.dequantize_rows(wq, w_scale).double().t() + (0 if bias is None else bias.double())
    y = y.to(dtype).float()
    d = 2 * cos_cache.shape[-1]
    cos, sin = cos_cache[pos].to(dtype).float(), sin_cache[pos].to(dtype).float()

    def rope(t):  # [heads, d] NeoX, each product rounded, then the sum
        t1, t2 = t[:, : d // 2], t[:, d // 2:]
        r = lambda v: v.to(dtype).float()  # noqa: E731
        return torch.cat([r(t1 * cos) - r(t2 * sin), r(t2 * cos) + r(t1 * sin)], dim=-1).to(dtype)

    q = rope(y[0, : hq * d].view(hq, d)).reshape(1, hq * d)
    k = rope(y[0, hq * d: (hq + hkv) * d].view(hkv, d))
    v = y[0, (hq + hkv) * d:].view(hkv, d).to(dtype)
    block_size = kv_cache.shape[2]
    if kv_cache.element_size() == 1:
        top = torch.finfo(kv_cache.dtype).max
        k, v = k.float().clamp(-top, top), v.float().clamp(-top, top)
    kv_cache[0, slot // block_size, slot % block_size] = k.to(kv_cache.dtype)
    kv_cache[1, slot // block_size, slot % block_size] = v.to(kv_cache.dtype)
    return q, s


def make_case(device: str, dtype, cache_dtype, with_residual: bool, with_bias: bool, seed: int = 0,
              hq: int = 4, hkv: int = 2, d: int = 16, k: int = 96):
    gen = torch.Generator().manual_seed(seed)
    n = (hq + 2 * hkv) * d
    wq, w_scale = fp8_ops.quantize_rows(torch.randn(n, k, generator=gen) * 0.2)
    x = torch.randn(1, k, generator=gen).to(dtype)
    residual = torch.randn(1, k, generator=gen).to(dtype) if with_residual else None
    g = (torch.rand(k, generator=gen) + 0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.arange(64).float()[:, None] * inv[None, :]
    cos_cache, sin_cache = angles.cos(), angles.sin()
    kv_cache = torch.zeros(2, 3, 4, hkv, d, dtype=cache_dtype)
    tensors = (x, residual, g, wq, w_scale, bias, cos_cache, sin_cache, kv_cache)
    return [None if t is None else t.to(device) for t in tensors], (hq, hkv)


def check(device: str, dtype, cache_dtype, with_residual: bool, with_bias: bool, **shape) -> float:
    """Relative max error of q, the cache's k and v against the reference; the new residual exactly."""
    from pagedllm.quantization.kernels import fp8_qkv_rope

    (x, residual, g, wq, w_scale, bias, cos_cache, sin_cache, kv_cache), (hq, hkv) = make_case(
        device, dtype, cache_dtype, with_residual, with_bias, **shape)
    pos, slot = 37, 6
    positions = torch.tensor([pos], device=device)
    slots = torch.tensor([slot], device=device)
    want_cache = kv_cache.clone().cpu()
    want_q, want_res = reference(*(t if t is None else t.cpu() for t in (x, residual, g)), 1e-5, wq.cpu(),
                                 w_scale.cpu(), None if bias is None else bias.cpu(), pos, cos_cache.cpu(),
                                 sin_cache.cpu(), hq, hkv, want_cache, slot)
    assert fp8_qkv_rope.fits(x, residual, g, wq, w_scale, cos_cache, kv_cache, hq, hkv)
    q, new_res = fp8_qkv_rope.fp8_qkv_rope(x, residual, g, 1e-5, wq, w_scale, bias, positions, cos_cache, sin_cache,
                                           hq, hkv, kv_cache, slots)
    assert torch.equal(new_res.cpu(), want_res)
    got_cache = kv_cache.cpu().float()
    untouched = torch.ones(3, 4, dtype=torch.bool)
    untouched[slot // 4, slot % 4] = False
    assert not got_cache[:, untouched].any()  # only the row's slot written
    errs = [(q.cpu().float() - want_q.float()).abs().max() / want_q.float().abs().max()]
    for half in (0, 1):
        got, want = got_cache[half, slot // 4, slot % 4], want_cache[half, slot // 4, slot % 4].float()
        errs.append((got - want).abs().max() / want.abs().max())
    return float(max(errs))


# (dtype, cache dtype, residual, bias, tolerance): fp16 in the interpreter; a float8 cache within one
# step of its format (the interpreter's float8 rounding is not the GPU's at every value).
CASES = [
    (torch.float16, torch.float16, True, False, 1e-3),
    (torch.float16, torch.float8_e4m3fn, False, True, 0.13),
    (torch.float16, torch.float8_e5m2, True, True, 0.26),
]


def _interpreter_main() -> None:
    for dtype, cache_dtype, with_residual, with_bias, tol in CASES:
        err = check("cpu", dtype, cache_dtype, with_residual, with_bias)
        assert err < tol, (cache_dtype, err)
        print("ok", cache_dtype, err)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_fp8_qkv_rope_matches_the_unfused_ops_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    code = f"import runpy; runpy.run_path({__file__!r})['_interpreter_main']()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok") == len(CASES)


def test_qkv_layer_routes_the_one_launch_path_to_the_fp8_method(monkeypatch):
    """A quantized QKVLinear with the fused kernels on asks its FP8 method (which asks ``fp8_ops``:
    forced here) instead of the float kernel; with them off, or a norm that does not fuse, None."""
    from pagedllm.config import KernelConfig
    from pagedllm.layers import prepare_model_kernels, triton_ops
    from pagedllm.models import build_model, init_dummy_weights
    from tests.helpers import tiny_config

    monkeypatch.setattr(triton_ops, "HAS_TRITON", True)
    calls = []
    monkeypatch.setattr(fp8_ops, "norm_qkv_rope_store", lambda *a: calls.append(a[-6:-2]) or ("q", "res"))
    monkeypatch.setattr(triton_ops, "rms_norm_qkv_rope", lambda *a: pytest.fail("the float kernel"))
    for fused_ops in (True, False):
        model = init_dummy_weights(build_model(tiny_config("llama"), torch.float32, "cpu", fp8.Fp8Config.online()),
                                   seed=3)
        prepare_model_kernels(model, torch.device("cuda"), KernelConfig(fused_ops=fused_ops))
        layer = model.model.layers[0]
        qkv, norm = layer.self_attn.qkv_proj, layer.input_layernorm
        calls.clear()
        x = torch.randn(1, qkv.in_features)
        got = qkv.forward_norm_rope_store(x, None, norm, torch.zeros(1, dtype=torch.long), None, None, None, None)
        if fused_ops:
            assert got == ("q", "res") and calls == [(None, None, qkv.num_heads, qkv.num_kv_heads)]
            norm.fuses_kernels = False
            assert qkv.forward_norm_rope_store(x, None, norm, None, None, None, None, None) is None
        else:
            assert got is None and calls == []


def test_fp8_ops_declines_on_the_cpu():
    (x, residual, g, wq, w_scale, bias, cos_cache, sin_cache, kv_cache), (hq, hkv) = make_case(
        "cpu", torch.bfloat16, torch.bfloat16, True, False)
    assert fp8_ops.norm_qkv_rope_store(x, residual, g, 1e-5, wq, w_scale, bias, torch.zeros(1), cos_cache,
                                       sin_cache, hq, hkv, kv_cache, torch.zeros(1)) is None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_fp8_qkv_rope_matches_the_unfused_ops_on_cuda(cache_dtype):
    err = check("cuda", torch.bfloat16, cache_dtype, True, False, hq=32, hkv=8, d=128, k=4096)
    assert err < (1e-2 if cache_dtype == torch.bfloat16 else 0.13), err
