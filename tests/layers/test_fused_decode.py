"""The decode GEMVs with a fused prologue (layers/kernels/fused_gemv.py, layers/compound.py).

GPU tests (marked ``gpu``; on CUDA, or on the CPU under ``TRITON_INTERPRET=1 python -m pytest
--noconftest tests/layers``), as in test_triton_ops.py: each kernel on random inputs with strided
rows into NaN-poisoned outputs, against the torch path on the same device (``RMSNorm`` then
``F.linear``; ``SiluAndMul`` then ``F.linear``) at the dtype's tolerance; the new residual must equal
``x + residual`` bit for bit. Shapes cover M = 1, 2, 4, K not a multiple of BLOCK_K and N not a
multiple of BLOCK_N (explicit small blocks, and a chunked sum-of-squares pass), and the default
launch parameters; then capture in a CUDA graph, and a tiny random Llama / Qwen2 / Qwen3 model
decoding at batch 1 and 2 with and without the fusions (also under the interpreter, with the fused
ops let onto CPU tensors).

CPU tests (CI): the dispatch predicates follow ``skinny_gemm_fits``, and on the CPU the compound
modules are the unfused modules, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.config import KernelConfig
from pagedllm.layers import (
    Linear,
    NormLinear,
    ResidualState,
    RMSNorm,
    SiluAndMul,
    SiluAndMulLinear,
    prepare_model_kernels,
    triton_ops,
)
from pagedllm.layers.tuning import HOPPER
from tests.layers.test_triton_ops import (
    DEVICE,
    DTYPES,
    HAS_CUDA,
    INTERPRET,
    assert_graph_replay_matches,
    assert_matches,
    cuda_test,
    kernel_test,
    make_norm,
    make_rope,
    native_ops,
    on_cuda_kernels,
    poisoned_like,
    randn,
)

# (M, N, K, block_n, block_k); None: the default launch parameters (as the model gets them).
GEMV_SHAPES = [
    (1, 100, 77, 16, 32),  # N % BLOCK_N != 0, K % BLOCK_K != 0
    (2, 100, 77, 16, 32),
    (2, 96, 1000, 32, 256),
    (4, 40, 200, 16, 64),
    (1, 256, 1024, None, None),
    (2, 128, 1536, None, None),
]
if not INTERPRET:  # model-sized where it is fast: Qwen3-0.6B qkv and down, Llama-8B qkv, hidden 8192, and
    # Llama-8B's gate_up and down sizes (the large-weight launch parameters: K <= 4096 and K > 4096)
    GEMV_SHAPES += [(1, 4096, 1024, None, None), (2, 1024, 3072, None, None), (1, 6144, 4096, None, None),
                    (1, 1024, 8192, None, None), (1, 28672, 4096, None, None), (1, 4096, 14336, None, None)]


def make_linear(n: int, k: int, dtype, gen, bias: bool) -> Linear:
    linear = Linear(k, n, bias).to(device=DEVICE, dtype=dtype)
    linear.weight.data.copy_(randn(n, k, scale=k**-0.5, gen=gen))
    if bias:
        linear.bias.data.copy_(randn(n, scale=0.5, gen=gen))
    return linear


def shape_id(shape) -> str:
    m, n, k, block_n, block_k = shape
    return f"m{m}-n{n}-k{k}" + (f"-b{block_n}x{block_k}" if block_n else "-default")


# ---- kernels vs torch path -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GEMV_SHAPES, ids=shape_id)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@kernel_test
def test_rms_norm_linear_kernel(dtype, shape, with_residual, bias):
    from pagedllm.layers.kernels.fused_gemv import rms_norm_linear

    m, n, k, block_n, block_k = shape
    gen = torch.Generator(DEVICE).manual_seed(m * 7919 + n * 31 + k)
    norm, linear = make_norm(k, dtype, gen), make_linear(n, k, dtype, gen, bias)
    # strided rows: x and residual are column slices of wider buffers
    x = randn(m, k + 48, dtype=dtype, scale=3.0, gen=gen)[:, 16 : 16 + k]
    residual = randn(m, k + 8, dtype=dtype, gen=gen)[:, :k] if with_residual else None
    x_before = x.clone()
    res_before = residual.clone() if with_residual else None
    if with_residual:
        normed, ref_res = norm(x, residual)
    else:
        normed, ref_res = norm(x), x
    ref = F.linear(normed, linear.weight, linear.bias)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    res_out = poisoned_like(x) if with_residual else None
    # explicit blocks: the sum of squares also accumulates over several K chunks (with a tail)
    got, got_res = rms_norm_linear(x, residual, norm.weight, norm.eps, linear.weight, linear.bias, out=out,
                                   residual_out=res_out, block_n=block_n, block_k=block_k)
    assert got is out
    assert torch.equal(x, x_before) and (not with_residual or torch.equal(residual, res_before)), "inputs modified"
    assert_matches(out, ref)
    if with_residual:
        assert got_res is res_out
        assert_matches(res_out, ref_res)
        if dtype != torch.bfloat16 or not INTERPRET:  # the interpreter truncates when it casts to bf16
            assert torch.equal(res_out, ref_res), "x + residual must be one rounding, as in torch"
    else:
        assert got_res is x, "without a residual the new residual is x itself"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GEMV_SHAPES, ids=shape_id)
@pytest.mark.parametrize("bias", [False, True])
@kernel_test
def test_silu_and_mul_linear_kernel(dtype, shape, bias):
    from pagedllm.layers.kernels.fused_gemv import silu_and_mul_linear

    m, n, k, block_n, block_k = shape
    gen = torch.Generator(DEVICE).manual_seed(m * 7919 + n * 31 + k + 1)
    linear = make_linear(n, k, dtype, gen, bias)
    x = randn(m, 2 * k + 8, dtype=dtype, scale=2.0, gen=gen)[:, 8:]  # strided rows, [gate | up]
    x_before = x.clone()
    ref = F.linear(SiluAndMul()(x), linear.weight, linear.bias)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    got = silu_and_mul_linear(x, linear.weight, linear.bias, out=out, block_n=block_n, block_k=block_k)
    assert got is out and torch.equal(x, x_before)
    assert_matches(out, ref)


# (num_q_heads, num_kv_heads, head_dim, K, block_n, block_k); None: the default launch parameters.
QKV_ROPE_CASES = [
    (4, 2, 16, 64, None, None),  # the tiny test models' attention
    (6, 2, 64, 200, 8, 64),  # K % BLOCK_K != 0, 4 dim pairs per program
    (8, 8, 128, 256, 16, 128),  # no GQA, 8 pairs per program
    (4, 1, 128, 160, 256, 64),  # 128 pairs asked for: capped at head_dim / 2 = 64
]
if not INTERPRET:  # SmolLM2-135M and Llama-3.1-8B
    QKV_ROPE_CASES += [(9, 3, 64, 576, None, None), (32, 8, 128, 4096, None, None)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", QKV_ROPE_CASES, ids=lambda c: f"h{c[0]}-kv{c[1]}-d{c[2]}-k{c[3]}-b{c[4]}")
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("slot", [37, -1])
@kernel_test
def test_rms_norm_qkv_rope_kernel(dtype, case, with_residual, bias, slot):
    """Norm + qkv + RoPE + KV store in one launch against the torch path (RMSNorm, F.linear,
    apply_rotary, the reference KV store) into a NaN-poisoned cache: q matches, the row's k and v land
    in its slot and nowhere else (nowhere at slot -1, a padding token), the residual is exact."""
    from pagedllm.attention.torch_ref import store_kv_cache
    from pagedllm.layers.kernels.fused_gemv import rms_norm_qkv_rope
    from pagedllm.layers.rotary import apply_rotary

    num_q, num_kv, head_dim, k, block_n, block_k = case
    gen = torch.Generator(DEVICE).manual_seed(num_q * 131 + head_dim + k)
    n = (num_q + 2 * num_kv) * head_dim
    norm, qkv = make_norm(k, dtype, gen), make_linear(n, k, dtype, gen, bias)
    rope = make_rope(head_dim, max_position=512)
    x = randn(1, k + 16, dtype=dtype, scale=3.0, gen=gen)[:, 16:]
    residual = randn(1, k, dtype=dtype, gen=gen) if with_residual else None
    positions = torch.tensor([300], device=DEVICE)
    slots = torch.tensor([slot], dtype=torch.int64, device=DEVICE)
    x_before = x.clone()
    normed, ref_res = norm(x, residual) if with_residual else (norm(x), x)
    q, kk, v = F.linear(normed, qkv.weight, qkv.bias).split([num_q * head_dim, num_kv * head_dim,
                                                              num_kv * head_dim], dim=-1)
    cos, sin = rope.cos_sin(positions)
    q_ref = apply_rotary(q.view(1, num_q, head_dim), cos, sin).view(1, -1)
    k_ref = apply_rotary(kk.view(1, num_kv, head_dim), cos, sin)
    cache_ref = torch.full((2, 4, 16, num_kv, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    if slot >= 0:
        store_kv_cache(k_ref, v.reshape(1, num_kv, head_dim), cache_ref, slots)
    cache = torch.full_like(cache_ref, float("nan"))
    q_out = torch.full((1, num_q * head_dim), float("nan"), dtype=dtype, device=DEVICE)
    res_out = poisoned_like(x) if with_residual else None
    got_q, got_res = rms_norm_qkv_rope(x, residual, norm.weight, norm.eps, qkv.weight, qkv.bias, positions,
                                       rope.cos_cache, rope.sin_cache, num_q, num_kv, cache, slots, q_out=q_out,
                                       residual_out=res_out, block_n=block_n, block_k=block_k)
    assert got_q is q_out and torch.equal(x, x_before)
    assert_matches(q_out, q_ref)
    assert torch.equal(cache.isnan(), cache_ref.isnan()), "k/v written outside the row's slot"
    if slot >= 0:
        written = ~cache_ref.isnan()
        assert_matches(cache[written], cache_ref[written])
    if with_residual:
        assert got_res is res_out
        if dtype != torch.bfloat16 or not INTERPRET:  # the interpreter truncates when it casts to bf16
            assert torch.equal(res_out, ref_res)
    else:
        assert got_res is x
    if not INTERPRET and dtype != torch.float32:
        # Given the kernel's own projection (at position 0 cos = 1 and sin = 0 leave q and k as
        # projected), the rotation is torch's bit for bit, and v is stored as projected. (In float32
        # the kernel, compiled with FMA contraction for its dot products, may fuse the rotation's
        # multiply and add.)
        cache0 = torch.zeros_like(cache)
        proj_q, _ = rms_norm_qkv_rope(x, residual, norm.weight, norm.eps, qkv.weight, qkv.bias,
                                      torch.zeros_like(positions), rope.cos_cache, rope.sin_cache, num_q, num_kv,
                                      cache0, slots, block_n=block_n, block_k=block_k)
        assert torch.equal(q_out, apply_rotary(proj_q.view(1, num_q, head_dim), cos, sin).view(1, -1))
        if slot >= 0:
            block, offset = divmod(slot, cache.shape[2])
            proj_k = cache0[0, block, offset][None]
            assert torch.equal(cache[0, block, offset][None], apply_rotary(proj_k, cos, sin))
            assert torch.equal(cache[1, block, offset], cache0[1, block, offset])


def test_qkv_rope_pairs_never_straddle_heads():
    pytest.importorskip("triton")
    from pagedllm.layers.kernels.fused_gemv import qkv_rope_pairs_per_program

    assert qkv_rope_pairs_per_program(8, 128) == 4
    assert qkv_rope_pairs_per_program(256, 128) == 64
    assert qkv_rope_pairs_per_program(16, 80) == 8  # 40 pairs per head: 8 divides it
    assert qkv_rope_pairs_per_program(16, 96) == 8  # 48 pairs per head
    assert qkv_rope_pairs_per_program(4, 2) == 1


@pytest.mark.parametrize("with_residual", [False, True])
@kernel_test
def test_fused_kernels_allocate_their_outputs(with_residual):
    """Without ``out=``: new tensors of the right shape; the new residual never aliases an input."""
    from pagedllm.layers.kernels.fused_gemv import rms_norm_linear, silu_and_mul_linear

    gen = torch.Generator(DEVICE).manual_seed(5)
    dtype, m, n, k = torch.float16, 2, 72, 160
    norm, linear = make_norm(k, dtype, gen), make_linear(n, k, dtype, gen, False)
    x = randn(m, k, dtype=dtype, gen=gen)
    residual = randn(m, k, dtype=dtype, gen=gen) if with_residual else None
    y, new_res = rms_norm_linear(x, residual, norm.weight, norm.eps, linear.weight, None, block_n=32, block_k=64)
    assert y.shape == (m, n) and y.dtype == dtype and y.is_contiguous()
    if with_residual:
        assert new_res.data_ptr() not in (x.data_ptr(), residual.data_ptr())
        assert torch.equal(new_res, x + residual)
    else:
        assert new_res is x
    down = make_linear(n, k // 2, dtype, gen, False)
    z = silu_and_mul_linear(x, down.weight, None, block_n=32, block_k=64)
    assert z.shape == (m, n) and z.dtype == dtype


def pair_state(hidden: torch.Tensor, residual: torch.Tensor | None = None) -> ResidualState:
    """A residual state in the pair form: ``hidden`` not yet added to ``residual``."""
    state = ResidualState(hidden)
    state.residual = residual
    return state


@pytest.mark.parametrize("m", [1, 2])
@cuda_test
def test_fused_gemvs_capture_in_cuda_graph(m):
    """Capture norm-GEMV (with and without residual) + activation-GEMV at M rows (at M=2 the qkv
    shape takes the two-launch path), replay on fresh inputs copied into the static buffers."""
    gen = torch.Generator(DEVICE).manual_seed(6)
    dtype, hidden, inter = torch.bfloat16, 1024, 3072
    norm, act = make_norm(hidden, dtype, gen), SiluAndMul()
    qkv, down = make_linear(4096, hidden, dtype, gen, True), make_linear(hidden, inter, dtype, gen, False)
    on_cuda_kernels(norm, act, qkv, down)
    norm_qkv, act_down = NormLinear(norm, qkv), SiluAndMulLinear(act, down)
    x, residual = (torch.empty(m, hidden, dtype=dtype, device=DEVICE) for _ in range(2))
    gate_up = torch.empty(m, 2 * inter, dtype=dtype, device=DEVICE)

    def step():
        state = pair_state(x, residual)
        y = norm_qkv(state)
        return y, state.residual, norm_qkv(pair_state(x)), act_down(gate_up, pair_state(None)).hidden

    def fill():
        for t in (x, residual, gate_up):
            t.copy_(randn(*t.shape, dtype=dtype, gen=gen))

    assert_graph_replay_matches(fill, step, (norm, act, qkv, down))


# ---- the model, fused vs unfused -----------------------------------------------------------------


def _tiny_model(arch: str, dtype: torch.dtype):
    from pagedllm.models import build_model, init_dummy_weights
    from tests.helpers import tiny_config

    model = init_dummy_weights(build_model(tiny_config(arch), dtype, DEVICE), seed=3, std=0.15)
    gen = torch.Generator(DEVICE).manual_seed(4)
    with torch.no_grad():  # non-trivial norm weights and biases (init_dummy_weights sets 1 and 0)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(randn(*param.shape, scale=0.1, gen=gen) + 1)
            elif name.endswith(".bias"):
                param.copy_(randn(*param.shape, scale=0.1, gen=gen))
    return model


def _decode_logits(model, steps: int = 3) -> torch.Tensor:
    """Prefill two prompts, then decode ``steps`` tokens of request 0 alone (M=1) and ``steps`` of
    both together (M=2), feeding fixed tokens; the decode steps' logits, stacked. On CUDA with the
    Triton attention backend, else the reference one."""
    from tests.helpers import PagedTestRunner

    backend = None
    if HAS_CUDA:  # the engine's backend on CUDA (it takes K/V stored by the fused kernels)
        from pagedllm.attention.triton_backend import TritonBackend

        backend = TritonBackend()
    runner = PagedTestRunner(model, num_blocks=64, block_size=4, backend=backend)
    runner.step([(0, list(range(3, 14))), (1, list(range(20, 27)))])
    logits = []
    for i in range(steps):
        logits += runner.step([(0, [100 + i])])
    for i in range(steps):
        logits += runner.step([(0, [200 + i]), (1, [300 + i])])
    return torch.cat(logits)


def _fused_ops_on_cpu_tensors(monkeypatch) -> None:
    """Let the fused kernels take CPU tensors (the interpreter): the CUDA implementations' dispatch."""
    monkeypatch.setattr(triton_ops, "fusable", lambda x: x.dtype in triton_ops.FUSED_DTYPES)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# Relative logit error (fused vs the same model with separate launches, fused vs the native ops).
# The norm GEMVs never round the normed row (one pass, fused_gemv.py), which the separate launches do:
# in bf16 about one rounding of the linear's input. Under the interpreter bf16 is looser still, from
# its truncating bf16 casts (which the cuBLAS stand-in does not make).
MODEL_TOL = {
    torch.float16: (2e-3, 1e-2),
    torch.bfloat16: (4e-2, 1e-1) if INTERPRET else (3e-2, 5e-2),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@kernel_test
def test_model_fused_decode_matches_unfused(arch, dtype, monkeypatch):
    """A tiny model decoding at batch 1 and 2: the same logits with the fused norm/activation GEMVs,
    with every fused op on but these two (isolating them), and with all fused ops off."""
    if not HAS_CUDA:  # the interpreter: let the fused ops take CPU tensors
        _fused_ops_on_cpu_tensors(monkeypatch)
        # skinny_gemm's K loop has a runtime bound, which the interpreter cannot run with numpy 2.4
        # (it converts the 1-element bound with int()): the plain GEMV is F.linear there.
        monkeypatch.setattr(triton_ops, "skinny_linear", F.linear)
        monkeypatch.setattr(triton_ops, "lm_head_linear", lambda x, w, tuning: F.linear(x, w))
    calls: list[str] = []
    for name in ("rms_norm_linear", "silu_and_mul_linear", "rms_norm_qkv_rope"):
        fn = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name, lambda *a, _fn=fn, _name=name: calls.append(_name) or _fn(*a))
    model = _tiny_model(arch, dtype)
    on_cuda_kernels(model)
    fused = _decode_logits(model)
    layers = len(model.model.layers)
    # M=1 steps: every layer's qkv and gate_up take the norm GEMV, down the activation GEMV; M=2 steps:
    # only down (N=64 <= 1024 and K=128 >= 2N in these tiny models). On CUDA the qkv GEMV of the
    # models without a q/k norm also does the RoPE and the KV store (the Triton backend takes stored
    # K/V; under the interpreter the reference backend runs, which does not).
    qkv_rope = HAS_CUDA and arch != "qwen3"
    assert calls.count("rms_norm_qkv_rope") == (3 * layers if qkv_rope else 0)
    assert calls.count("rms_norm_linear") == 3 * layers * (1 if qkv_rope else 2)
    assert calls.count("silu_and_mul_linear") == 3 * layers + 3 * layers
    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(triton_ops, "norm_prologue_fits", lambda *a: False)
        m.setattr(triton_ops, "act_prologue_fits", lambda *a: False)
        separate = _decode_logits(model)
    assert not calls
    with native_ops(model):
        unfused = _decode_logits(model)
    assert not calls
    assert torch.isfinite(fused).all()
    # From `separate`: the unrounded normed row and float32 summation order; bf16 noise from `unfused`.
    tol_separate, tol_unfused = MODEL_TOL[dtype]
    assert _rel(fused, separate) < tol_separate, f"fused vs separate launches: {_rel(fused, separate):.3g}"
    assert _rel(fused, unfused) < tol_unfused, f"fused vs all-torch path: {_rel(fused, unfused):.3g}"
    assert (fused.argmax(-1) == separate.argmax(-1)).float().mean() >= 0.8


# ---- CPU: dispatch and the unfused path ------------------------------------------------------------


def test_dispatch_follows_skinny_gemm_fits(monkeypatch):
    """The fused prologues are taken exactly where the linear alone takes the Triton GEMV (checked
    with CPU tensors standing in for CUDA ones)."""
    _fused_ops_on_cpu_tensors(monkeypatch)
    bf16, tuning = torch.bfloat16, HOPPER
    for m in (1, 2, 3):
        for n, k in [(4096, 1024), (6144, 1024), (1024, 3072), (1024, 2048), (6144, 4096), (28672, 4096),
                     (4096, 14336)]:
            x = torch.zeros(m, k, dtype=bf16)
            w = torch.zeros(n, k, dtype=bf16)
            g = torch.ones(k, dtype=bf16)
            skinny = triton_ops.skinny_gemm_fits(x, w, tuning)
            assert triton_ops.norm_prologue_fits(x, None, g, w, tuning) == skinny
            assert triton_ops.norm_prologue_fits(x, torch.zeros_like(x), g, w, tuning) == skinny
            gate_up = torch.zeros(m, 2 * k, dtype=bf16)
            assert triton_ops.act_prologue_fits(gate_up, w, tuning) == skinny
    # Qwen3-0.6B at M=1: qkv, gate_up and down; at M=2 only down. Llama-8B at M=1: only qkv.
    x1, x2 = torch.zeros(1, 1024, dtype=bf16), torch.zeros(2, 1024, dtype=bf16)
    g = torch.ones(1024, dtype=bf16)
    assert triton_ops.norm_prologue_fits(x1, None, g, torch.zeros(4096, 1024, dtype=bf16), tuning)
    assert not triton_ops.norm_prologue_fits(x2, x2, g, torch.zeros(4096, 1024, dtype=bf16), tuning)
    assert triton_ops.act_prologue_fits(torch.zeros(2, 6144, dtype=bf16), torch.zeros(1024, 3072, dtype=bf16), tuning)
    # Mismatched dtypes or shapes keep the two-launch path.
    w = torch.zeros(4096, 1024, dtype=bf16)
    assert not triton_ops.norm_prologue_fits(x1, None, g.float(), w, tuning)
    assert not triton_ops.norm_prologue_fits(x1, x1.half(), g, w, tuning)
    assert not triton_ops.norm_prologue_fits(x1, torch.zeros(1, 512, dtype=bf16), g, w, tuning)
    assert not triton_ops.act_prologue_fits(torch.zeros(1, 2048, dtype=bf16), torch.zeros(1024, 3072, dtype=bf16),
                                            tuning)
    # A linear prepared without the fused kernels never takes a prologue.
    linear = Linear(1024, 4096).to(bf16)
    prepare_model_kernels(linear, torch.device("cuda"), KernelConfig(fused_ops=False))
    assert linear.impl == "cublas" and linear.forward_norm_prologue(x1, None, RMSNorm(1024).to(bf16)) is None
    # Norm + qkv + RoPE + KV store: one row where the norm GEMV applies, a float32 table, a cache of x's dtype.
    cos = torch.zeros(64, 64)
    cache = torch.zeros(2, 4, 16, 8, 128, dtype=bf16)
    assert triton_ops.norm_qkv_rope_fits(x1, x1, g, w, cos, cache, tuning)
    assert not triton_ops.norm_qkv_rope_fits(x2, x2, g, w, cos, cache, tuning)  # two rows
    assert not triton_ops.norm_qkv_rope_fits(x1, x1, g, torch.zeros(28672, 4096, dtype=bf16)[:, :1024], cos,
                                             cache, tuning)  # not the GEMV (a strided weight)
    assert not triton_ops.norm_qkv_rope_fits(x1, x1, g, w, cos.half(), cache, tuning)
    assert not triton_ops.norm_qkv_rope_fits(x1, x1, g, w, cos, cache.float(), tuning)
    assert not triton_ops.norm_qkv_rope_fits(x1, x1, g, w, cos[:, :32], cache, tuning)  # partial rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_cpu_compound_modules_are_the_unfused_modules(dtype, m):
    gen = torch.Generator().manual_seed(m)
    norm = RMSNorm(48, 1e-5).to(dtype)
    norm.weight.data.copy_(torch.randn(48, generator=gen) * 0.2 + 1)
    qkv, down = Linear(48, 40, bias=True).to(dtype), Linear(24, 48).to(dtype)
    for p in (*qkv.parameters(), *down.parameters()):
        p.data.copy_(torch.randn(p.shape, generator=gen).to(dtype))
    x, residual = torch.randn(m, 48, generator=gen).to(dtype), torch.randn(m, 48, generator=gen).to(dtype)
    norm_qkv = NormLinear(norm, qkv)
    state = pair_state(x, residual)
    y = norm_qkv(state)
    normed, ref_res = norm(x, residual)
    assert torch.equal(y, qkv(normed)) and torch.equal(state.residual, ref_res)
    state = pair_state(x)
    y = norm_qkv(state)
    assert torch.equal(y, qkv(norm(x))) and state.residual is x
    gate_up = torch.randn(m, 48, generator=gen).to(dtype)
    out = SiluAndMulLinear(SiluAndMul(), down)(gate_up, pair_state(None)).hidden
    assert torch.equal(out, down(SiluAndMul()(gate_up)))
