"""FP8 weights at batch rows (33-128 rows: a batched decode step): the Triton tensor-core GEMM
(pagedllm/quantization/kernels/fp8_mm.py), the fused norm / SiLU-and-mul + activation-quantization
kernels (kernels/fp8_act_quant.py) and the layer's dispatch among ``fp8_ops.BATCH_GEMMS``: against
torch references under Triton's interpreter in CI (a subprocess with ``TRITON_INTERPRET=1``) and on
CUDA (``gpu``: the 8B shapes, bit for bit against the unfused ops, a captured CUDA graph)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from pagedllm.quantization import fp8, fp8_ops

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs Triton and CUDA")

# (rows M, outputs N, inputs K, bias, config (block_m, block_n, block_k, num_warps, num_stages, tma) or
# None): ragged M / N / K tails, two row blocks, TMA loads (zero-filled tails) and pointer loads.
MM_CASES = [
    (40, 72, 200, True, None),
    (33, 64, 256, False, None),
    (20, 96, 256, False, (16, 64, 64, 4, 2, False)),
    (70, 64, 128, True, (32, 64, 32, 4, 2, False)),
    (40, 72, 192, True, (32, 64, 64, 4, 2, True)),
    (70, 64, 256, False, (64, 64, 64, 4, 3, True)),
]


def check_mm_case(case, device: str, seed: int = 0) -> float:
    """Relative max error of ``fp8_mm`` against the float64 product of the dequantized codes for one case."""
    from pagedllm.quantization.kernels import fp8_mm

    m, n, k, with_bias, config = case
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    # Made on the CPU (the seed), quantized and multiplied on ``device`` (float64 there: the 8B shapes).
    wq, w_scale = fp8_ops.quantize_rows((torch.randn(n, k, generator=gen) * 0.05).to(device))
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    bias = torch.randn(n, generator=gen).to(dtype).to(device) if with_bias else None
    xq, x_scale = fp8_ops.quantize_activations(x, None)
    want = (xq.double() * x_scale.double()) @ fp8_ops.dequantize_rows(wq, w_scale, torch.float64).t()
    want += 0 if bias is None else bias.double()
    assert fp8_mm.fits(xq, x_scale, wq, w_scale)
    got = fp8_mm.fp8_mm(xq, x_scale, wq, w_scale, bias, dtype, config)
    assert got.dtype == dtype and got.shape == (m, n)
    return float((got.double() - want).abs().max() / want.abs().max())


def unfused_codes(x: torch.Tensor, residual: torch.Tensor | None, g: torch.Tensor | None, eps: float = 1e-6):
    """The torch ops the fused kernels stand for, rounded as the Triton norm and ``SiluAndMul`` round:
    ``(codes, scales, new residual)`` of the norm (``g`` given) or of SiLU-and-mul (``g`` None)."""
    if g is None:
        k = x.shape[1] // 2
        gate, up = x[:, :k].float(), x[:, k:].float()
        act = ((gate / (1 + torch.exp(-gate))).to(x.dtype).float() * up).to(x.dtype)
        return (*fp8_ops.quantize_activations(act, None), None)
    s = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    normed = (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (*fp8_ops.quantize_activations((normed.float() * g.float()).to(x.dtype), None), s)


def fused_codes(x: torch.Tensor, residual: torch.Tensor | None, g: torch.Tensor | None, eps: float = 1e-6):
    if g is None:
        return (*fp8_ops.silu_and_mul_quant(x), None)
    return fp8_ops.rms_norm_quant(x, residual, g, eps)


def _interpreter_main() -> None:
    for case in MM_CASES:
        err = check_mm_case(case, "cpu")
        assert err < 2e-3, (case, err)
        print("ok", case, err)
    gen = torch.Generator().manual_seed(1)
    for m, k, kind in ((3, 96, "norm"), (2, 100, "norm-no-residual"), (3, 80, "act")):
        x = torch.randn(m, 2 * k if kind == "act" else k, generator=gen).half()
        residual = torch.randn(m, k, generator=gen).half() if kind == "norm" else None
        g = None if kind == "act" else (torch.rand(k, generator=gen) + 0.5).half()
        from pagedllm.quantization.kernels import fp8_act_quant

        args = (x, fp8_ops.FP8_MAX, fp8_ops.MIN_SCALE) if g is None else (
            x, residual, g, 1e-6, fp8_ops.FP8_MAX, fp8_ops.MIN_SCALE)
        got = (fp8_act_quant.silu_and_mul_quant if g is None else fp8_act_quant.rms_norm_quant)(*args)
        want = unfused_codes(x, residual, g)
        # Exact scales and residual; the codes mostly equal (the interpreter's float8 rounding is not
        # the GPU's at binade edges: the GPU test checks them bit for bit).
        assert torch.equal(got[1], want[1]), kind
        assert (got[0].float() == want[0].float()).float().mean() > 0.9, kind
        if g is not None:
            assert torch.equal(got[2], want[2]), kind
        print("ok", kind)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_fp8_mm_and_fused_codes_match_the_references_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    code = f"import runpy; runpy.run_path({__file__!r})['_interpreter_main']()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok") == len(MM_CASES) + 3


class _Layer(nn.Module):
    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        wq, scale = fp8_ops.quantize_rows(torch.randn(n, k) * 0.05)
        self.weight, self.weight_scale = nn.Parameter(wq, requires_grad=False), nn.Parameter(scale, requires_grad=False)
        self.bias = None


@pytest.mark.parametrize("kind", fp8_ops.BATCH_GEMMS)
def test_batch_rows_take_the_chosen_gemm_with_codes_from_the_op_before(monkeypatch, kind):
    """At batch rows the layer multiplies codes by ``batch_gemm``'s choice: the norm / SiLU-and-mul
    write them (one launch) and plain ``apply`` quantizes first. A static or weight-only scheme never
    takes codes it did not compute (forced here: CUDA is not there)."""
    calls = []
    y = torch.zeros(40, 24)
    codes = (torch.zeros(40, 32, dtype=torch.float8_e4m3fn), torch.ones(40, 1))
    monkeypatch.setattr(fp8_ops, "batch_gemm", lambda x, wq, s: kind)
    monkeypatch.setattr(fp8_ops, "batch_product", lambda k, x, xs, *a: calls.append((k, x.dtype)) or y)
    monkeypatch.setattr(fp8_ops, "rms_norm_quant", lambda x, r, g, eps: (*codes, "residual"))
    monkeypatch.setattr(fp8_ops, "silu_and_mul_quant", lambda x: codes)
    monkeypatch.setattr(fp8_ops, "quantize_activations", lambda x, s, per_token=True: (x.to(torch.float8_e4m3fn), x))
    layer = _Layer(24, 32)
    method = fp8.Fp8LinearMethod(fp8.Fp8Scheme(serialized=True, activations="token"))
    norm = nn.Module()
    norm.weight, norm.eps = nn.Parameter(torch.ones(32)), 1e-6
    x = torch.randn(40, 32)
    assert method.apply_norm_prologue(layer, x, x.clone(), norm) == (y, "residual")
    assert method.apply_act_prologue(layer, torch.randn(40, 64)) is y
    assert method.apply(layer, x, None).data_ptr() == y.data_ptr()
    assert calls == [(kind, torch.float8_e4m3fn)] * 3
    calls.clear()
    for activations in ("static", None):
        other = fp8.Fp8LinearMethod(fp8.Fp8Scheme(serialized=True, activations=activations))
        layer.input_scale = nn.Parameter(torch.tensor([0.05]), requires_grad=False)
        assert other.apply_norm_prologue(layer, x, None, norm) is None
        assert other.apply_act_prologue(layer, torch.randn(40, 64)) is None
    monkeypatch.undo()  # the static codes through the existing path, not the batch GEMM
    want = x @ fp8_ops.dequantize_rows(layer.weight, layer.weight_scale).t()
    y = fp8.Fp8LinearMethod(fp8.Fp8Scheme(serialized=True, activations="static")).apply(layer, x, None)
    torch.testing.assert_close(y, want, rtol=0.1, atol=0.1 * float(want.abs().max()))
    assert calls == []


def test_batch_gemm_is_none_on_the_cpu():
    layer = _Layer(32, 32)
    assert fp8_ops.batch_gemm(torch.randn(64, 32).bfloat16(), layer.weight, layer.weight_scale) is None
    assert fp8_ops.rms_norm_quant(torch.randn(64, 32), None, torch.ones(32), 1e-6) is None
    assert fp8_ops.silu_and_mul_quant(torch.randn(64, 64)) is None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (28672, 4096)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_fp8_mm_matches_the_reference_on_cuda(shape):
    from pagedllm.quantization.kernels import fp8_mm

    n, k = shape
    for m, tma in ((33, True), (64, True), (64, False), (100, True), (128, False)):
        config = fp8_mm.mm_config(m, n, k)[:-1] + (tma,)
        err = check_mm_case((m, n, k, m == 100, config), "cuda")
        assert err < 1e-2, (m, tma, err)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["norm", "norm-no-residual", "act"])
@pytest.mark.parametrize("rows", [33, 64])
def test_fused_codes_equal_the_unfused_cuda_ops(kind, rows):
    """Bit for bit the two launches the engine ran before: the Triton RMSNorm / SiLU-and-mul, then the
    per-token quantization."""
    from pagedllm.layers import triton_ops

    gen = torch.Generator().manual_seed(rows)
    k = 14336 if kind == "act" else 4096
    x = torch.randn(rows, 2 * k if kind == "act" else k, generator=gen).bfloat16().cuda()
    residual = torch.randn(rows, k, generator=gen).bfloat16().cuda() if kind == "norm" else None
    g = None if kind == "act" else (torch.rand(k, generator=gen) + 0.5).bfloat16().cuda()
    if g is None:
        want = (*fp8_ops.quantize_activations(triton_ops.silu_and_mul(x), None), None)
    else:
        out = triton_ops.rms_norm(x, g, 1e-6, residual)
        normed, new_residual = out if residual is not None else (out, x)
        want = (*fp8_ops.quantize_activations(normed, None), new_residual)
    got = fused_codes(x, residual, g)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0].float(), want[0].float()), kind
    if g is not None:
        assert torch.equal(got[2], want[2])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", fp8_ops.BATCH_GEMMS)
def test_layer_batch_rows_on_cuda_replay_in_a_cuda_graph(monkeypatch, kind):
    """Each batch GEMM through the layer's method (plain and with the norm prologue) at 64 rows, eager
    and replayed from a CUDA graph, against the float product (the codes' rounding within 5%)."""
    monkeypatch.setattr(fp8_ops, "BATCH_GEMM", kind)
    layer = _Layer(512, 256).cuda()
    method = fp8.Fp8LinearMethod(fp8.Fp8Scheme(serialized=True, activations="token"))
    norm = nn.Module()
    norm.weight, norm.eps = nn.Parameter(torch.ones(256, dtype=torch.bfloat16, device="cuda")), 1e-6
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    assert fp8_ops.batch_gemm(x, layer.weight, layer.weight_scale) == kind
    w = fp8_ops.dequantize_rows(layer.weight, layer.weight_scale)

    def run():
        return method.apply(layer, x, None), method.apply_norm_prologue(layer, x, None, norm)[0]

    def check(y, y_norm):
        want = x.float() @ w.t()
        torch.testing.assert_close(y.float(), want, rtol=5e-2, atol=5e-2 * float(want.abs().max()))
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        want = normed @ w.t()
        torch.testing.assert_close(y_norm.float(), want, rtol=5e-2, atol=5e-2 * float(want.abs().max()))

    check(*run())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    check(*out)


def _compile_for_hopper(fn, signature: dict, constants: dict, aligned: tuple = (), **options):
    """``fn`` built for sm_90 with Triton's bundled ptxas (no GPU needed); its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("Triton without its bundled ptxas")
    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    attrs = {(list(signature).index(name),): [["tt.divisibility", 16]] for name in aligned}
    kernel = triton.compile(ASTSource(fn, signature, constants, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                            options=options)
    return kernel.asm["ptx"]


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_fp8_mm_compiles_to_hopper_fp8_tensor_core_dots(tma):
    """The batch-row GEMM built for sm_90 at its 8B launch sizes: its dot is an e4m3 x e4m3 wgmma, the
    loads are the TMA's or 16-byte cp.async, nothing in local memory."""
    from pagedllm.quantization.kernels import fp8_mm

    block_m, block_n, block_k, num_warps, num_stages, _ = fp8_mm.mm_config(64, 28672, 4096)
    ints = ("M", "N", "K", "stride_xm", "stride_wn", "stride_om")
    signature = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "b_ptr": "*bf16",
                 "out_ptr": "*bf16", **dict.fromkeys(ints, "i32")}
    if tma:
        signature.update(x_ptr=f"tensordesc<fp8e4nv[{block_m}, {block_k}]>",
                         w_ptr=f"tensordesc<fp8e4nv[{block_n}, {block_k}]>")
    constants = {"HAS_BIAS": True, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "TMA": tma}
    aligned = ("xs_ptr", "ws_ptr", "b_ptr", "out_ptr", "N", "K", "stride_xm", "stride_wn", "stride_om")
    ptx = _compile_for_hopper(fp8_mm._fp8_mm_kernel, signature, constants,
                              aligned + (() if tma else ("x_ptr", "w_ptr")), num_warps=num_warps, num_stages=num_stages)
    dots = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    assert dots and all("e4m3.e4m3" in line for line in dots)
    assert ("cp.async.bulk.tensor" if tma else "cp.async.cg.shared.global") in ptx
    assert "ld.local" not in ptx


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_fused_code_kernels_compile_for_hopper_without_local_memory():
    """The norm / SiLU-and-mul + codes kernels at the 8B rows (4096 and 14336 columns, 16 warps) keep
    their row in registers."""
    from pagedllm.quantization.kernels import fp8_act_quant

    floats = dict.fromkeys(("fp8_max", "min_scale"), "fp32")
    norm = {"x_ptr": "*bf16", "res_ptr": "*bf16", "res_out_ptr": "*bf16", "g_ptr": "*bf16", "xq_ptr": "*fp8e4nv",
            "scale_ptr": "*fp32", "K": "i32", "eps": "fp32", **floats, "stride_x": "i32", "stride_res": "i32",
            "stride_res_out": "i32"}
    ptx = _compile_for_hopper(fp8_act_quant._rms_norm_quant_kernel, norm, {"HAS_RESIDUAL": True, "BLOCK": 4096},
                              num_warps=fp8_act_quant._warps(4096))
    assert "ld.local" not in ptx
    act = {"x_ptr": "*bf16", "xq_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "K": "i32", "stride_x": "i32", **floats}
    ptx = _compile_for_hopper(fp8_act_quant._silu_and_mul_quant_kernel, act, {"BLOCK": 16384},
                              num_warps=fp8_act_quant._warps(16384))
    assert "ld.local" not in ptx


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv"])
def test_batch1_qkv_rope_kernel_compiles_for_hopper_without_local_memory(cache):
    """The one-launch norm + FP8 qkv GEMV + RoPE + K/V store (kernels/fp8_qkv_rope.py) for the 8B
    shapes, under PDL, with a float or float8 cache."""
    from pagedllm.quantization.kernels import fp8_qkv_rope

    pointers = {"x_ptr": "*bf16", "res_ptr": "*bf16", "g_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                "b_ptr": "*fp32", "q_out_ptr": "*bf16", "res_out_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*fp32",
                "sin_ptr": "*fp32", "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}", "slot_ptr": "*i64"}
    ints = ("stride_wn", "stride_cache", "stride_c_blk", "stride_c_slot", "stride_c_head")
    signature = {**pointers, "K": "i32", "eps": "fp32", **dict.fromkeys(ints, "i32")}
    constants = {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_DIM": 128, "HAS_RESIDUAL": True, "HAS_BIAS": False,
                 "SATURATE_AT": 448.0 if cache == "fp8e4nv" else 0.0, "BLOCK_P": fp8_qkv_rope.BLOCK_P,
                 "BLOCK_K": fp8_qkv_rope.BLOCK_K, "BLOCK_SIZE": 16, "USE_PDL": True, "PREFETCH": True}
    ptx = _compile_for_hopper(fp8_qkv_rope._fp8_qkv_rope_kernel, signature, constants, num_warps=fp8_qkv_rope.NUM_WARPS)
    assert "griddepcontrol.wait" in ptx and "ld.local" not in ptx
