"""FP8 KV cache (``kv_cache_dtype``): the conversions, every backend against the torch reference on a
float8 cache, the reference against float attention over the rounded K/V, and the engine."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.attention.cpu_backend import CpuBackend
from pagedllm.attention.kv_dtype import from_cache_dtype, kv_cache_torch_dtype, to_cache_dtype
from pagedllm.attention.torch_ref import TorchRefBackend
from pagedllm.native import kernels as cpu_kernels
from tests.attention.test_triton_backend import (
    _patch_interpreter_scalar_index,
    attend,
    make_inputs,
    random_specs,
    rel_err,
)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def fp8_inputs(specs, cache_dtype, dtype=torch.float32, seed=0, **shape):
    """``make_inputs`` with the cache converted to ``cache_dtype`` (its random contents too)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, cache, meta = make_inputs(specs, dtype=dtype, device="cpu", gen=gen, **shape)
    return q, k, v, to_cache_dtype(cache, cache_dtype), meta


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("name,dtype", [("auto", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn),
                                        ("fp8_e5m2", torch.float8_e5m2)])
def test_cache_dtype_names(name, dtype):
    assert kv_cache_torch_dtype(name, torch.bfloat16) == dtype


def test_fp8_cache_needs_fp8_capable_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="^kv_cache_dtype='fp8_e4m3' needs a GPU of compute capability 8.9"):
        kv_cache_torch_dtype("fp8_e4m3", torch.bfloat16, torch.device("cuda:0"))
    assert kv_cache_torch_dtype("auto", torch.bfloat16, torch.device("cuda:0")) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert kv_cache_torch_dtype("fp8_e5m2", torch.bfloat16, torch.device("cuda:0")) == torch.float8_e5m2


def test_engine_args_validate_kv_cache_dtype():
    with pytest.raises(ValueError, match="^kv_cache_dtype must be one of"):
        EngineArgs(kv_cache_dtype="int8")
    for name in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
        assert EngineArgs(kv_cache_dtype=name).kv_cache_dtype == name


@pytest.mark.parametrize("dtype", FP8)
def test_store_saturates_and_rounds(dtype):
    big = torch.finfo(dtype).max
    x = torch.tensor([1e9, -1e9, 0.3, -2.0, 0.0])
    y = to_cache_dtype(x, dtype)
    assert y.dtype == dtype
    assert from_cache_dtype(y, torch.float32).tolist()[:2] == [big, -big]  # no NaN / inf
    assert from_cache_dtype(y, torch.float32)[3] == -2.0
    mantissa_bits = 3 if dtype == torch.float8_e4m3fn else 2
    assert abs(float(from_cache_dtype(y, torch.float32)[2]) - 0.3) <= 0.3 * 2.0 ** -(mantissa_bits + 1)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_reference_on_fp8_is_float_attention_over_rounded_kv(dtype, kind):
    """The reference with a float8 cache = the reference with a float32 cache holding the same
    (rounded) values: storing rounds once, reading is exact."""
    gen = torch.Generator().manual_seed(1)
    specs = random_specs(gen, kind, 9, max_seq=120)
    q, k, v, cache, meta = fp8_inputs(specs, dtype, block_size=16, num_kv_heads=2, qpk=3, head_dim=64)
    k, v = 4 * k, 4 * v  # spread over the format's exponents
    float_cache = cache.float()
    out = attend(TorchRefBackend(), q, k, v, cache, meta, 0.125)
    rk, rv = (to_cache_dtype(t, dtype).float() for t in (k, v))
    ref = attend(TorchRefBackend(), q, rk, rv, float_cache, meta, 0.125)
    assert torch.equal(cache.float(), float_cache)
    n = meta.num_actual_tokens
    torch.testing.assert_close(out[:n], ref[:n], rtol=1e-5, atol=1e-5)
    exact = attend(TorchRefBackend(), q, k, v, torch.zeros_like(float_cache), meta, 0.125)
    assert not torch.allclose(out[:n], exact[:n], rtol=1e-4, atol=1e-4), "the rounding must show"


needs_kernel = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler to build the CPU kernels")


@needs_kernel
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("block_size,num_kv_heads,qpk,head_dim", [(16, 3, 3, 64), (8, 4, 2, 32), (4, 2, 1, 128)])
def test_cpu_kernel_on_fp8_matches_reference(dtype, block_size, num_kv_heads, qpk, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    specs = random_specs(gen, "mixed", 11, max_seq=200)
    q, k, v, cache, meta = fp8_inputs(specs, dtype, block_size=block_size, num_kv_heads=num_kv_heads, qpk=qpk,
                                      head_dim=head_dim, seed=head_dim)
    ref_cache = cache.clone()
    out = attend(CpuBackend(), q, k, v, cache, meta, head_dim ** -0.5)
    ref = attend(TorchRefBackend(), q, k, v, ref_cache, meta, head_dim ** -0.5)
    assert same_bytes(cache, ref_cache)
    n = meta.num_actual_tokens
    torch.testing.assert_close(out[:n], ref[:n], rtol=2e-5, atol=2e-5)
    assert not out[n:].any()


@needs_kernel
def test_cpu_backend_takes_the_native_kernel_on_fp8(monkeypatch):
    calls = []
    real = cpu_kernels.paged_decode_attention
    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", lambda *a: calls.append(1) or real(*a))
    q, k, v, cache, meta = fp8_inputs([(30, 1), (5, 1)], torch.float8_e4m3fn, block_size=16, num_kv_heads=2, qpk=2,
                                      head_dim=64)
    attend(CpuBackend(), q, k, v, cache, meta, 0.125)
    assert calls == [1]


# ---------------------------------------------------------------------------------------------
# Triton: the interpreter on the CPU (CI), the device in the GPU tests
# ---------------------------------------------------------------------------------------------

def _check_triton(q, k, v, cache, meta, tol):
    from pagedllm.attention.triton_backend import TritonBackend

    cache_ref, cache_tri = cache.clone(), cache.clone()
    ref = attend(TorchRefBackend(), q, k, v, cache_ref, meta, 0.125)
    out = torch.full_like(q, float("nan"))
    got = attend(TritonBackend(), q, k, v, cache_tri, meta, 0.125, out=out)
    assert same_bytes(cache_tri, cache_ref), "the Triton store must write the reference's bytes"
    n = meta.num_actual_tokens
    assert torch.all(got[n:] == 0)
    err = rel_err(got[:n], ref[:n])
    assert err < tol, f"relative error {err:.2e}"
    return err


def _interpreter_main() -> None:
    """fp8 caches through the Triton store and both attention kernels (run in a subprocess). The new
    K/V are float8 values already: Triton 3.6's interpreter rounds some float32 -> float8 casts wrongly
    (a rounding that carries into the exponent: -0.4995 becomes -0.25), which the GPU's ``cvt`` does
    not; the rounding of unrounded values is checked byte for byte on the device
    (``test_fp8_triton_on_gpu_matches_reference``)."""
    _patch_interpreter_scalar_index()
    for dtype in FP8:
        for qdtype, tol in ((torch.float32, 1e-4), (torch.float16, 5e-3)):
            specs = [(37, 1), (70, 70), (90, 20), (5, 1)]
            q, k, v, cache, meta = fp8_inputs(specs, dtype, qdtype, block_size=16, num_kv_heads=2, qpk=2, head_dim=64)
            k, v = (to_cache_dtype(t, dtype).to(qdtype) for t in (k, v))
            print("fp8", dtype, qdtype, _check_triton(q, k, v, cache, meta, tol))
    q, k, v, cache, meta = fp8_inputs([(3, 1)], torch.float8_e4m3fn, block_size=16, num_kv_heads=2, qpk=2,
                                      head_dim=64, num_pad_tokens=0)
    k = to_cache_dtype(k, torch.float8_e4m3fn).float()
    k[..., ::2] = torch.where(k[..., ::2] > 0, 1e4, -1e4)
    _check_triton(q, k, to_cache_dtype(v, torch.float8_e4m3fn).float(), cache, meta, 1e-4)  # saturates, no NaN


@pytest.mark.slow
def test_fp8_kernels_in_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    code = f"import runpy; runpy.run_path({__file__!r})['_interpreter_main']()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("block_size,qpk,head_dim", [(16, 2, 128), (32, 4, 64), (16, 4, 96)])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_fp8_triton_on_gpu_matches_reference(dtype, block_size, qpk, head_dim, kind):
    gen = torch.Generator().manual_seed(block_size + head_dim)
    specs = random_specs(gen, kind, 24, max_seq=1500)
    q, k, v, cache, meta = make_inputs(specs, block_size=block_size, num_kv_heads=2, qpk=qpk, head_dim=head_dim,
                                       dtype=torch.bfloat16, device="cuda", gen=gen)
    _check_triton(q, k, v, to_cache_dtype(cache, dtype), meta, 1e-2)


# ---------------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.helpers import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


def _engine_cache(llm: LLM) -> tuple[int, torch.Tensor]:
    core = llm.llm_engine.engine_core
    return core.scheduler.block_pool.num_blocks, core.executor.worker.model_runner.kv_caches[0]


@pytest.mark.parametrize("dtype,ratio", [("float32", 4), ("bfloat16", 2)])
def test_fp8_cache_holds_more_blocks_in_the_same_memory(tiny_llama, dtype, ratio, caplog):
    args = dict(model=tiny_llama, dtype=dtype, kv_cache_memory=1 << 20, max_model_len=128, max_num_seqs=2)
    auto_blocks, auto_cache = _engine_cache(LLM(**args))
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        fp8_blocks, fp8_cache = _engine_cache(LLM(kv_cache_dtype="fp8", **args))
    assert f"KV cache: {fp8_blocks} blocks of 16 tokens in float8_e4m3fn (1 byte(s) an element" in caplog.text
    assert fp8_cache.dtype == torch.float8_e4m3fn and auto_cache.dtype == getattr(torch, dtype)
    assert fp8_blocks // ratio == auto_blocks  # the byte budget divided by 1/ratio of the bytes per block
    assert _engine_cache(LLM(kv_cache_dtype="fp8_e5m2", **args))[1].dtype == torch.float8_e5m2


def test_fp8_engine_greedy_is_sane(tiny_llama):
    """Greedy decoding on the tiny model with an fp8 cache: the native CPU kernel and the reference
    backend give the same tokens and logprobs; the prompt logprobs stay near the float cache's (this
    random model's K/V are small, partly in e4m3's subnormal range) and differ from them."""
    args = dict(model=tiny_llama, max_model_len=128, max_num_seqs=4, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=0, logprobs=0)
    prompts = [{"prompt_token_ids": [(7 * i + 3) % 500 + 1 for i in range(n)]} for n in (40, 9, 23)]
    runs = {(cache, backend): LLM(kv_cache_dtype=cache, attention_backend=backend, **args).generate(
        prompts, params, use_tqdm=False) for cache, backend in (("auto", "cpu"), ("fp8", "cpu"), ("fp8", "torch_ref"))}
    diffs = []
    for a, b, r in zip(runs["auto", "cpu"], runs["fp8", "cpu"], runs["fp8", "torch_ref"]):
        assert len(b.outputs[0].token_ids) == 12 and b.outputs[0].token_ids == r.outputs[0].token_ids
        for lb, lr in zip(b.outputs[0].logprobs, r.outputs[0].logprobs):
            assert lb.keys() == lr.keys()
            assert all(abs(lb[t].logprob - lr[t].logprob) < 1e-4 for t in lb)
        ids = a.prompt_token_ids
        diffs += [abs(a.prompt_logprobs[i][t].logprob - b.prompt_logprobs[i][t].logprob) for i, t in enumerate(ids)
                  if i > 0]
    assert 0 < sum(diffs) / len(diffs) < 0.1 and max(diffs) < 0.5, (sum(diffs) / len(diffs), max(diffs))


@pytest.mark.gpu
def test_fp8_engine_on_gpu_is_sane():
    """Qwen3-0.6B's shape with random weights on the GPU (fused RoPE + K/V store kernels, decode CUDA
    graphs): an fp8 cache of half the bytes per block, finite prompt logprobs near the bf16 cache's."""
    args = dict(model="benchmarks/configs/qwen3-0.6b", load_format="dummy", skip_tokenizer_init=True,
                max_model_len=1024, max_num_seqs=8, num_gpu_blocks_override=256, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(37 * i + n) % 5000 + 1 for i in range(n)]} for n in (300, 17, 120)]
    runs = {}
    for name in ("auto", "fp8"):
        llm = LLM(kv_cache_dtype=name, **args)
        runs[name] = llm.generate(prompts, params, use_tqdm=False)
        assert _engine_cache(llm)[1].dtype == (torch.float8_e4m3fn if name == "fp8" else torch.bfloat16)
        del llm
    diffs = []
    for a, b in zip(runs["auto"], runs["fp8"]):
        assert len(b.outputs[0].token_ids) == 16
        diffs += [abs(a.prompt_logprobs[i][t].logprob - b.prompt_logprobs[i][t].logprob)
                  for i, t in enumerate(a.prompt_token_ids) if i > 0]
    assert all(d == d for d in diffs) and 0 < sum(diffs) / len(diffs) < 0.5, sum(diffs) / len(diffs)


def test_fp8_decode_launch_config_keeps_two_tiles_in_flight():
    """A float8 cache's decode tiles are prefetched two deep (5 stages), which its shared memory
    holds (K/V at 1 byte, one V tile staged in float16): the budget check must not cut them back
    as if the tiles were float16 (it did: 5 stages of 64 keys became 4, one tile in flight)."""
    pytest.importorskip("triton")
    from pagedllm.attention.triton_kernels import paged_attention as pa

    assert pa.decode_config(2, 1) == pa.decode_config(2, 8) == pa._DECODE_CONFIG
    assert pa.decode_config(1, 1) == pa._FP8_DECODE_CONFIG and pa.decode_config(1, 4) == pa._FP8_DECODE_SPLIT_CONFIG
    for tile_n, _, stages in (pa._FP8_DECODE_CONFIG, pa._FP8_DECODE_SPLIT_CONFIG):
        assert pa._fit_tiles(16, tile_n, stages, 128, 2, 1) == (tile_n, stages)
    assert pa._fit_tiles(16, 64, 3, 128, 2, 2) == (64, 3)  # bf16: unchanged
    assert pa._fit_tiles(16, 64, 5, 128, 4, 4) == (64, 2)  # fp32 (tests): cut back as before
