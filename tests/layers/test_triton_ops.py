"""The layers' fused Triton kernels against their torch paths (the oracle), and the torch paths on CPU.

GPU tests (marked ``gpu``): each kernel on fresh random inputs (several shapes; bf16/fp16/fp32;
strided rows and non-contiguous q/k views of a merged qkv buffer) into NaN-poisoned outputs, compared
with the layer's torch path on the same device: relative error ``|out - ref| / |ref|`` under the
dtype's tolerance and every output element written. Then the layers' dispatch on CUDA, and capture
in a CUDA graph. The kernels also run on the CPU under Triton's interpreter:
``TRITON_INTERPRET=1 python -m pytest --noconftest tests/layers`` (the interpreter truncates when it
casts to bf16, so bf16 there only meets the loose tolerance).

CPU tests (CI, no Triton needed): the torch paths equal HF's formulas, and nothing imports Triton.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedllm.config import KernelConfig
from pagedllm.layers import (
    CustomOp,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    apply_rotary,
    prepare_model_kernels,
    triton_ops,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Relative error |out - ref| / |ref| allowed per dtype (the kernels round where the torch path rounds,
# so in practice only the norm's float32 summation order differs). The interpreter truncates to bf16.
REL_TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 3e-2 if INTERPRET else 8e-3}

_needs_kernels = pytest.mark.skipif(
    not (HAS_TRITON and (HAS_CUDA or INTERPRET)), reason="needs Triton and CUDA (or TRITON_INTERPRET=1)"
)
_needs_cuda = pytest.mark.skipif(not (HAS_TRITON and HAS_CUDA), reason="needs Triton and CUDA")


def kernel_test(fn):
    return pytest.mark.gpu(_needs_kernels(fn))


def cuda_test(fn):
    return pytest.mark.gpu(_needs_cuda(fn))


def randn(*shape, dtype=torch.float32, scale=1.0, gen=None) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def poisoned_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not torch.isnan(out).any(), "an output element was not written (still NaN)"
    diff = (out.double() - ref.double()).norm().item()
    rel = diff / max(ref.double().norm().item(), 1e-30)
    assert rel < REL_TOL[out.dtype], f"relative error {rel:.3g} (tolerance {REL_TOL[out.dtype]:.0e}, {out.dtype})"


def on_cuda_kernels(*modules: torch.nn.Module) -> None:
    """Choose the CUDA implementations (the fused kernels) for ``modules`` and their submodules, as
    the engine's ``prepare_model_kernels`` does (norms not folded)."""
    prepare_model_kernels(torch.nn.ModuleList(modules), torch.device("cuda"), KernelConfig(fold_norms=False))


@contextlib.contextmanager
def native_ops(*modules: torch.nn.Module):
    """Inside the block, ``modules`` and their submodules run their native (torch) implementation."""
    ops = {m: m.impl for root in modules for m in root.modules() if isinstance(m, CustomOp)}
    for op in ops:
        op.use_impl("native")
    try:
        yield
    finally:
        for op, impl in ops.items():
            op.use_impl(impl)


def assert_graph_replay_matches(fill, step, modules) -> None:
    """Capture ``step()`` (the fused kernels) in a CUDA graph after a warm-up outside the capture,
    then twice: ``fill()`` the static inputs anew, replay, and compare every output with the unfused
    torch path of ``modules`` run eagerly on the same inputs."""
    fill()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile + warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(2):
        fill()
        graph.replay()
        with native_ops(*modules):
            ref = step()
        for out, r in zip(outs, ref):
            assert_matches(out, r)


def make_norm(size: int, dtype, gen, eps=1e-6) -> RMSNorm:
    norm = RMSNorm(size, eps).to(device=DEVICE, dtype=dtype)
    norm.weight.data.copy_(randn(size, scale=0.2, gen=gen) + 1)
    return norm


def make_rope(head_dim: int, max_position: int = 4096, theta: float = 1e6) -> RotaryEmbedding:
    with torch.device(DEVICE):
        return RotaryEmbedding(types.SimpleNamespace(rope_theta=theta), head_dim, max_position)


# ---- kernels vs torch path -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
# max_block 256 forces the two-pass loop; the widest rows take only the one-pass path (the loop is
# covered by the smaller shapes).
@pytest.mark.parametrize("rows,hidden,max_block", [
    (rows, hidden, max_block)
    for rows, hidden in [(1, 1024), (7, 1000), (256, 1024), (33, 4096), (5, 8192), (3, 12288)]
    for max_block in (8192, 256)
    if max_block == 8192 or hidden <= 4096
])
@pytest.mark.parametrize("with_residual", [False, True])
@kernel_test
def test_rms_norm_kernel(dtype, rows, hidden, with_residual, max_block):
    from pagedllm.layers.kernels.rms_norm import rms_norm

    gen = torch.Generator(DEVICE).manual_seed(rows * hidden)
    norm = make_norm(hidden, dtype, gen)
    # strided rows: x and residual are column slices of wider buffers
    x = randn(rows, hidden + 64, dtype=dtype, scale=3.0, gen=gen)[:, 32 : 32 + hidden]
    residual = randn(rows, hidden + 16, dtype=dtype, gen=gen)[:, :hidden] if with_residual else None
    out, res_out = poisoned_like(x), poisoned_like(x)
    ref = norm(x, residual)  # a fresh module: the torch path on CUDA tensors
    got = rms_norm(x, norm.weight, norm.eps, residual, out=out, residual_out=res_out, max_block=max_block)
    if with_residual:
        assert got[0] is out and got[1] is res_out
        assert_matches(out, ref[0])
        assert_matches(res_out, ref[1])
        if dtype != torch.bfloat16 or not INTERPRET:
            assert torch.equal(res_out, ref[1])  # the add is one rounding, as in torch
    else:
        assert got is out
        assert_matches(out, ref)


ROPE_SHAPES = [  # (tokens, q heads, kv heads, head_dim)
    (1, 16, 8, 128),  # Qwen3-0.6B decode, batch 1
    (256, 16, 8, 128),
    (37, 32, 8, 64),
    (5, 4, 4, 64),
    (3, 28, 4, 128),  # q heads not a multiple of the head block
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("layout", ["qkv_view", "head_major"])
@kernel_test
def test_qk_norm_rope_kernel(dtype, shape, with_norm, layout):
    from pagedllm.layers.kernels.rotary import qk_norm_rope

    tokens, num_heads, num_kv_heads, head_dim = shape
    gen = torch.Generator(DEVICE).manual_seed(tokens * num_heads + head_dim)
    rope = make_rope(head_dim)
    if layout == "qkv_view":  # views of the merged projection output, as the model passes them
        qkv = randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, scale=2.0, gen=gen)
        q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
        k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
    else:  # [heads, tokens, D] storage seen as [tokens, heads, D]
        q = randn(num_heads, tokens, head_dim, dtype=dtype, scale=2.0, gen=gen).transpose(0, 1)
        k = randn(num_kv_heads, tokens, head_dim, dtype=dtype, scale=2.0, gen=gen).transpose(0, 1)
    positions = torch.randint(0, rope.max_position, (tokens,), generator=gen, device=DEVICE)
    q_norm = make_norm(head_dim, dtype, gen) if with_norm else None
    k_norm = make_norm(head_dim, dtype, gen) if with_norm else None
    q_before, k_before = q.clone(), k.clone()
    ref_q, ref_k = rope(positions, q, k, q_norm, k_norm)  # fresh modules: the torch path
    q_out, k_out = poisoned_like(ref_q), poisoned_like(ref_k)
    norms = ((q_norm.weight, q_norm.eps), (k_norm.weight, k_norm.eps)) if with_norm else (None, None)
    got_q, got_k = qk_norm_rope(positions, q, k, rope.cos_cache, rope.sin_cache, *norms, q_out=q_out, k_out=k_out)
    assert got_q is q_out and got_k is k_out
    assert torch.equal(q, q_before) and torch.equal(k, k_before), "inputs must not be modified"
    assert_matches(q_out, ref_q)
    assert_matches(k_out, ref_k)
    if not with_norm and not INTERPRET:  # the rotation alone rounds as torch does, bit for bit
        assert torch.equal(q_out, ref_q) and torch.equal(k_out, ref_k)
    if dtype == torch.float32:
        torch.testing.assert_close(q_out, ref_q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(k_out, ref_k, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,size", [(1, 3072), (33, 1000), (256, 3072), (4, 11008)])
@kernel_test
def test_silu_and_mul_kernel(dtype, rows, size):
    from pagedllm.layers.kernels.activation import silu_and_mul

    gen = torch.Generator(DEVICE).manual_seed(rows + size)
    x = randn(rows, 2 * size + 8, dtype=dtype, scale=3.0, gen=gen)[:, 8:]  # strided rows
    ref = SiluAndMul()(x)  # a fresh module: the torch path
    out = poisoned_like(ref)
    assert silu_and_mul(x, out=out) is out
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,size,hidden", [(3, 3072, 1024), (37, 1000, 576)])
@kernel_test
def test_silu_and_mul_kernel_with_row_scale(dtype, rows, size, hidden):
    """``row_scale=(s, eps)``: gate and up scaled by each row's 1 / rms(s) first, as the layer's torch
    path (``norm.rms_scale`` then SiLU-and-mul) does."""
    from pagedllm.layers.kernels.activation import silu_and_mul

    gen = torch.Generator(DEVICE).manual_seed(rows + size)
    x = randn(rows, 2 * size, dtype=dtype, scale=3.0, gen=gen)
    s = randn(rows, hidden + 8, dtype=dtype, scale=5.0, gen=gen)[:, 8:]  # strided rows
    ref = SiluAndMul()(x, (s, 1e-6))
    out = poisoned_like(ref)
    assert silu_and_mul(x, out=out, row_scale=(s, 1e-6)) is out
    assert_matches(out, ref)


# ---- the layers' dispatch on CUDA ------------------------------------------------------------------


@cuda_test
def test_layers_take_the_fused_path_on_cuda(monkeypatch):
    calls: list[str] = []
    for name in ("rms_norm", "qk_norm_rope", "silu_and_mul"):
        fn = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name, lambda *a, _fn=fn, _name=name, **kw: calls.append(_name) or _fn(*a, **kw))
    gen = torch.Generator(DEVICE).manual_seed(0)
    dtype, tokens, heads, kv_heads, head_dim, hidden = torch.bfloat16, 9, 16, 8, 128, 1024
    norm, q_norm, k_norm = make_norm(hidden, dtype, gen), make_norm(head_dim, dtype, gen), make_norm(head_dim, dtype, gen)
    rope, act = make_rope(head_dim), SiluAndMul()
    on_cuda_kernels(norm, q_norm, k_norm, rope, act)
    x, residual = randn(tokens, hidden, dtype=dtype, gen=gen), randn(tokens, hidden, dtype=dtype, gen=gen)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, gen=gen)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.arange(100, 100 + tokens, device=DEVICE)
    gate_up = randn(tokens, 2 * 3072, dtype=dtype, gen=gen)

    def run_all():
        return (norm(x), *norm(x, residual), *rope(positions, q, k, q_norm, k_norm), *rope(positions, q, k), act(gate_up))

    fused = run_all()
    assert calls == ["rms_norm", "rms_norm", "qk_norm_rope", "qk_norm_rope", "silu_and_mul"]
    with native_ops(norm, q_norm, k_norm, rope, act):
        ref = run_all()
    assert len(calls) == 5, "the native implementation must be the torch path"
    for out, r in zip(fused, ref):
        assert_matches(out, r)


@cuda_test
def test_fused_ops_capture_in_cuda_graph():
    """Capture norm + rope + activation once, replay on fresh inputs copied into the static buffers."""
    gen = torch.Generator(DEVICE).manual_seed(1)
    dtype, tokens, heads, kv_heads, head_dim, hidden = torch.bfloat16, 64, 16, 8, 128, 1024
    norm, q_norm, k_norm = make_norm(hidden, dtype, gen), make_norm(head_dim, dtype, gen), make_norm(head_dim, dtype, gen)
    rope, act = make_rope(head_dim), SiluAndMul()
    on_cuda_kernels(norm, q_norm, k_norm, rope, act)
    x, residual = torch.empty(tokens, hidden, dtype=dtype, device=DEVICE), torch.empty(tokens, hidden, dtype=dtype, device=DEVICE)
    qkv = torch.empty(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    gate_up = torch.empty(tokens, 2 * 3072, dtype=dtype, device=DEVICE)
    positions = torch.zeros(tokens, dtype=torch.long, device=DEVICE)

    def step():
        q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
        return (*norm(x, residual), *rope(positions, q, k, q_norm, k_norm), act(gate_up))

    def fill():
        for t in (x, residual, qkv, gate_up):
            t.copy_(randn(*t.shape, dtype=dtype, gen=gen))
        positions.copy_(torch.randint(0, rope.max_position, (tokens,), generator=gen, device=DEVICE))

    assert_graph_replay_matches(fill, step, (norm, q_norm, k_norm, rope, act))


# ---- CPU: the torch paths (what CI runs) ------------------------------------------------------------


@pytest.fixture
def torch_path(monkeypatch):
    """Without the native CPU kernels (tests/native compares those with these torch paths)."""
    from pagedllm.native import kernels as native

    monkeypatch.setattr(native, "load", lambda: None)


def test_cpu_tensors_take_the_torch_path():
    assert not triton_ops.fusable(torch.randn(3, 8))
    assert RMSNorm(8).impl == "cpu"  # a fresh module: the CPU form (C kernel where it applies, else torch)


def test_layers_import_and_run_without_triton_kernels():
    """Importing the layers and models and running them on the CPU never imports the kernel modules."""
    code = (
        "import sys, torch\n"
        "import pagedllm.models\n"
        "from pagedllm.layers import RMSNorm, SiluAndMul\n"
        "RMSNorm(8)(torch.randn(2, 8), torch.randn(2, 8)); SiluAndMul()(torch.randn(2, 8))\n"
        "bad = [m for m in sys.modules if m.startswith('pagedllm.layers.kernels.')]\n"
        "assert not bad, bad\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={**os.environ, "PYTHONPATH": root})


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm / Qwen3RMSNorm forward."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_torch_path_is_hf(dtype, torch_path):
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(5, 64, generator=gen) * 3).to(dtype), torch.randn(5, 64, generator=gen).to(dtype)
    norm = RMSNorm(64, 1e-5).to(dtype)
    norm.weight.data.copy_(torch.randn(64, generator=gen) * 0.2 + 1)
    assert torch.equal(norm(x), _hf_rms_norm(x, norm.weight, 1e-5))
    normed, new_residual = norm(x, residual)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(normed, _hf_rms_norm(x + residual, norm.weight, 1e-5))


@pytest.mark.parametrize("with_norm", [False, True])
def test_rotary_forward_torch_path_is_hf(with_norm, torch_path):
    """``RotaryEmbedding.forward`` (q/k norm + NeoX RoPE on strided views) equals HF's Qwen3 ops in float32."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, head_dim = 6, 4, 2, 32
    rope = RotaryEmbedding(types.SimpleNamespace(rope_theta=1e6), head_dim, 512)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    q_norm = k_norm = None
    q_ref, k_ref = q, k
    if with_norm:
        q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
        q_norm.weight.data.normal_(1.0, 0.2, generator=gen)
        k_norm.weight.data.normal_(1.0, 0.2, generator=gen)
        q_ref, k_ref = _hf_rms_norm(q, q_norm.weight, 1e-6), _hf_rms_norm(k, k_norm.weight, 1e-6)
    cos, sin = rope.cos_sin(positions)
    cos, sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]  # HF: [1, T, D]
    hf_q, hf_k = apply_rotary_pos_emb(q_ref.transpose(0, 1)[None], k_ref.transpose(0, 1)[None], cos, sin)
    ours_q, ours_k = rope(positions, q, k, q_norm, k_norm)
    torch.testing.assert_close(ours_q, hf_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_k, hf_k[0].transpose(0, 1), rtol=0, atol=1e-6)
    cos_t, sin_t = rope.cos_sin(positions)
    assert torch.equal(ours_q, apply_rotary(q_norm(q) if with_norm else q, cos_t, sin_t))


def test_silu_and_mul_torch_path(torch_path):
    x = torch.randn(4, 2 * 24)
    assert torch.equal(SiluAndMul()(x), F.silu(x[:, :24]) * x[:, 24:])
