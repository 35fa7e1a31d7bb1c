"""The FP8 weight-only Triton GEMV (pagedllm/quantization/kernels/fp8_gemv.py) against the torch
reference that dequantizes: under Triton's interpreter in CI (small shapes, a subprocess with
``TRITON_INTERPRET=1``), and on CUDA (``gpu``: the 8B shapes, a captured CUDA graph, the layer's
dispatch between the GEMV and cuBLASLt)."""

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

# (rows M, outputs N, inputs K, dtype, bias[, config (block_n, block_k, num_warps, dot, split)]):
# config (block_n, block_k, num_warps, dot, split): per-element sums at one row, per-chunk sums at
# 2-4 rows (by config), the tensor cores (fp16: the interpreter's bf16 tl.dot is wrong), split K
# with uneven and empty splits, ragged N and K tails.
INTERPRETER_CASES = [
    (1, 40, 198, torch.float32, True),
    (1, 24, 256, torch.float32, False, (8, 64, 4, False, 1)),
    (1, 16, 256, torch.bfloat16, False, (8, 64, 4, False, 3)),  # 4 chunks in 3 splits: one empty
    (2, 24, 96, torch.float32, True, (16, 32, 4, False, 2)),
    (3, 24, 100, torch.float16, False),
    (5, 72, 96, torch.float16, True),
    (17, 64, 256, torch.float16, True, (32, 64, 4, True, 2)),
    (4, 40, 136, torch.bfloat16, True, (8, 32, 2, False, 5)),
]


def check_case(case, device: str, seed: int = 0) -> float:
    """Relative max error of the kernel against the dequantized float64 product for one case."""
    from pagedllm.quantization.kernels import fp8_gemv

    m, n, k, dtype, with_bias, *config = case
    gen = torch.Generator().manual_seed(seed)
    # Made on the CPU (the seed), quantized and multiplied on ``device`` (float64 there: the 8B shapes).
    wq, w_scale = fp8_ops.quantize_rows((torch.randn(n, k, generator=gen) * 0.05).to(device))
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    bias = torch.randn(n, generator=gen).to(dtype).to(device) if with_bias else None
    want = x.double() @ fp8_ops.dequantize_rows(wq, w_scale, torch.float64).t()
    if bias is not None:
        want += bias.double()
    assert fp8_gemv.fits(x, wq, w_scale)
    got = fp8_gemv.fp8_gemv(x, wq, w_scale, bias, config[0] if config else None)
    assert got.dtype == dtype and got.shape == (m, n)
    return float((got.double() - want).abs().max() / want.abs().max())


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# (rows M, outputs N, inputs K, dtype, prologue "norm" | "norm-no-residual" | "act", bias[, config]);
# no bfloat16 norm: the interpreter rounds float32 to bfloat16 by truncation (the residual sum differs).
PROLOGUE_CASES = [
    (1, 40, 200, torch.float32, "norm", True),
    (1, 40, 200, torch.float16, "norm", False, (8, 64, 4, False, 1)),
    (2, 24, 96, torch.float32, "norm-no-residual", False, (16, 32, 4, False, 1)),  # by config: 2+ rows
    (3, 16, 128, torch.float16, "norm", False, (8, 32, 2, False, 1)),
    (1, 40, 136, torch.float32, "act", True),
    (1, 40, 136, torch.float32, "act", False, (8, 32, 4, False, 3)),  # split K
    (4, 24, 96, torch.float16, "act", False, (8, 32, 4, False, 2)),  # split K: partial sums
]


def check_prologue_case(case, device: str, seed: int = 0) -> float:
    """Relative max error of a prologue GEMV against the torch ops then the dequantized product; checks
    the new residual (the norm) exactly."""
    from pagedllm.quantization.kernels import fp8_gemv

    m, n, k, dtype, prologue, with_bias, *config = case
    config = config[0] if config else None
    gen = torch.Generator().manual_seed(seed)
    wq, w_scale = fp8_ops.quantize_rows(torch.randn(n, k, generator=gen) * 0.05)
    w = fp8_ops.dequantize_rows(wq, w_scale).double()
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    if prologue == "act":
        x = torch.randn(m, 2 * k, generator=gen).to(dtype)
        act = torch.nn.functional.silu(x[:, :k].float()).to(dtype)
        inputs = (act.float() * x[:, k:].float()).to(dtype).double()
        assert fp8_gemv.fits(to(x), to(wq), to(w_scale), fp8_gemv.ACT_PROLOGUE)
        got = fp8_gemv.silu_and_mul_fp8_gemv(to(x), to(wq), to(w_scale), to(bias), config)
    else:
        x = torch.randn(m, k, generator=gen).to(dtype)
        residual = torch.randn(m, k, generator=gen).to(dtype) if prologue == "norm" else None
        g, eps = torch.rand(k, generator=gen).to(dtype) + 0.5, 1e-5
        s = x if residual is None else (x.float() + residual.float()).to(dtype)
        inputs = s.double() * torch.rsqrt(s.double().pow(2).mean(dim=1, keepdim=True) + eps) * g.double()
        got, new_residual = fp8_gemv.rms_norm_fp8_gemv(to(x), to(residual), to(g), eps, to(wq), to(w_scale),
                                                       to(bias), config)
        assert torch.equal(new_residual.cpu(), s)
    want = inputs @ w.t() + (0 if bias is None else bias.double())
    assert got.dtype == dtype and got.shape == (m, n)
    return float((got.double().cpu() - want).abs().max() / want.abs().max())


def _interpreter_main() -> None:
    from pagedllm.quantization.kernels import fp8_gemv

    # The CUDA-core form with and without the next chunk asked for early, one-row sums per element
    # or per chunk.
    for fp8_gemv.PREFETCH, fp8_gemv.CHUNK_SUMS in ((False, False), (True, False), (False, True), (True, True)):
        for case in INTERPRETER_CASES:
            err = check_case(case, "cpu")
            assert err < TOLERANCE[case[3]], (case, err)
            print("ok", case, err)
        for case in PROLOGUE_CASES:
            err = check_prologue_case(case, "cpu")
            assert err < TOLERANCE[case[3]], (case, err)
            print("ok", case, err)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_gemv_matches_the_reference_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    code = f"import runpy; runpy.run_path({__file__!r})['_interpreter_main']()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok") == 4 * (len(INTERPRETER_CASES) + len(PROLOGUE_CASES))


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_gemv_config_splits_k_only_where_the_row_blocks_leave_sms_idle():
    from pagedllm.quantization.kernels import fp8_gemv

    # gate_up at one row: 28672 / 8 = 3584 programs fill 132 SMs; o_proj: 512 programs, split 1 -> 264+.
    assert fp8_gemv.gemv_config(1, 28672, 4096, 132)[4] == 1
    assert fp8_gemv.gemv_config(1, 4096, 4096, 132) == (8, 1024, 4, False, 1)
    assert fp8_gemv.gemv_config(4, 4096, 4096, 132) == (32, 256, 4, True, 4)  # 128 row blocks x 4 >= 264
    assert fp8_gemv.gemv_config(16, 4096, 14336, 132)[3:] == (True, 8)  # 64 row blocks x 8 >= 264
    assert fp8_gemv.split_k(64, 256, 8, 128, 132) == 2  # never more splits than chunks


class _Layer(nn.Module):
    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        wq, scale = fp8_ops.quantize_rows(torch.randn(n, k, generator=torch.Generator().manual_seed(3)))
        self.weight, self.weight_scale = nn.Parameter(wq, requires_grad=False), nn.Parameter(scale, requires_grad=False)


@pytest.mark.parametrize("activations", ["token", "static", None])
def test_apply_takes_the_gemv_where_it_fits_with_the_bias_inside(monkeypatch, activations):
    """Every scheme's decode rows go to the weight-only GEMV (no activation quantization), which adds
    the bias itself; where it does not fit, the quantized-activation path runs."""
    calls = []

    def gemv(x, wq, w_scale, bias):
        calls.append(bias)
        return fp8_ops.fp8_linear_tiled(x, None, wq, w_scale, x.dtype) + (0 if bias is None else bias)

    layer, bias = _Layer(24, 32), torch.randn(24)
    layer.input_scale = nn.Parameter(torch.tensor([0.05]), requires_grad=False)
    x = torch.randn(2, 3, 32)
    method = fp8.Fp8LinearMethod(fp8.Fp8Scheme(serialized=True, activations=activations))
    monkeypatch.setattr(fp8_ops, "fp8_gemv", gemv)
    monkeypatch.setattr(fp8_ops, "quantize_activations", lambda *a, **k: pytest.fail("quantized the activations"))
    monkeypatch.setattr(fp8_ops, "gemv_fits", lambda x, wq, s: x.shape[0] <= 6)
    y = method.apply(layer, x, bias)
    assert y.shape == (2, 3, 24) and calls == [bias]
    want = x.reshape(6, 32) @ fp8_ops.dequantize_rows(layer.weight, layer.weight_scale).t() + bias
    torch.testing.assert_close(y.reshape(6, 24), want)
    monkeypatch.undo()
    assert not fp8_ops.gemv_fits(x.reshape(6, 32), layer.weight, layer.weight_scale)  # the CPU: never
    monkeypatch.setattr(fp8_ops, "fp8_gemv", lambda *a: pytest.fail("took the GEMV"))
    monkeypatch.setattr(fp8_ops, "gemv_fits", lambda x, wq, s: x.shape[0] <= 5)  # 6 rows: too many
    y = method.apply(layer, x, bias)
    torch.testing.assert_close(y.reshape(6, 24), want, rtol=0.1, atol=0.1 * float(want.abs().max()))


@pytest.mark.parametrize("fused_ops", [True, False])
def test_quantized_layers_run_the_fp8_prologue_gemvs_where_the_plan_allows_fused_kernels(monkeypatch, fused_ops):
    """A CUDA plan with the fused kernels on makes qkv / gate_up ask the FP8 method for the norm in
    the GEMV's prologue and down_proj for the activation (the method checks the shapes: forced here);
    with them off the layers decline and the compound modules run the ops."""
    from pagedllm.config import KernelConfig
    from pagedllm.layers import prepare_model_kernels, triton_ops
    from pagedllm.models import build_model, init_dummy_weights
    from tests.helpers import tiny_config

    monkeypatch.setattr(triton_ops, "HAS_TRITON", True)
    model = init_dummy_weights(build_model(tiny_config("llama"), torch.float32, "cpu", fp8.Fp8Config.online()), seed=3)
    prepare_model_kernels(model, torch.device("cuda"), KernelConfig(fused_ops=fused_ops))
    layer = model.model.layers[0]
    qkv, down, norm = layer.self_attn.qkv_proj, layer.mlp.down_proj, layer.input_layernorm
    calls = []
    monkeypatch.setattr(fp8_ops, "prologue_fits", lambda x, wq, s, prologue: True)
    monkeypatch.setattr(fp8_ops, "rms_norm_fp8_gemv", lambda *a: calls.append("norm") or ("y", "residual"))
    monkeypatch.setattr(fp8_ops, "silu_and_mul_fp8_gemv", lambda *a: calls.append("act") or "y")
    hidden = torch.randn(1, qkv.in_features)
    norm_fused = qkv.forward_norm_prologue(hidden, hidden.clone(), norm)
    act_fused = down.forward_act_prologue(torch.randn(1, 2 * down.in_features))
    if fused_ops:
        assert norm_fused == ("y", "residual") and act_fused == "y" and calls == ["norm", "act"]
        monkeypatch.setattr(fp8_ops, "prologue_fits", lambda x, wq, s, prologue: False)
        assert qkv.forward_norm_prologue(hidden, None, norm) is None  # the method declines: unfused
    else:
        assert norm_fused is None and act_fused is None and calls == []


GPU_SHAPES = [(6144, 4096), (4096, 14336), (28672, 4096)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("flags", [(False, False), (True, False), (False, True)], ids=["-", "prefetch", "chunk-sums"])
def test_gemv_matches_the_reference_on_cuda(monkeypatch, shape, flags):
    from pagedllm.quantization.kernels import fp8_gemv

    monkeypatch.setattr(fp8_gemv, "PREFETCH", flags[0])
    monkeypatch.setattr(fp8_gemv, "CHUNK_SUMS", flags[1])
    n, k = shape
    for m in (1, 2, 3, 4, 8, 16, 33, 64):
        err = check_case((m, n, k, torch.bfloat16, m == 3), "cuda")
        assert err < 1e-2, (m, err)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("prologue", ["norm", "norm-no-residual", "act"])
def test_prologue_gemvs_match_the_reference_on_cuda(prologue):
    from pagedllm.quantization.kernels import fp8_gemv

    n, k = (6144, 4096) if prologue != "act" else (4096, 14336)
    wq, w_scale = torch.empty(n, k, dtype=torch.float8_e4m3fn, device="cuda"), torch.ones(n, device="cuda")
    code = fp8_gemv.ACT_PROLOGUE if prologue == "act" else fp8_gemv.NORM_PROLOGUE
    for m, config in ((1, ()), (2, ((16, 512, 4, False, 1),))):  # 2 rows: the tensor cores by default
        x = torch.empty(m, 2 * k if prologue == "act" else k, device="cuda", dtype=torch.bfloat16)
        assert fp8_gemv.prologue_fits(x, wq, w_scale, code) == (m == 1), (prologue, m)
        err = check_prologue_case((m, n, k, torch.bfloat16, prologue, m == 2, *config), "cuda")
        assert err < 1e-2, (prologue, m, err)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gemv_replays_in_a_cuda_graph(m):
    from pagedllm.quantization.kernels import fp8_gemv

    wq, w_scale = fp8_ops.quantize_rows(torch.randn(4096, 4096, device="cuda"))
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    eager = fp8_gemv.fp8_gemv(x, wq, w_scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemv.fp8_gemv(x, wq, w_scale)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, fp8_gemv.fp8_gemv(x, wq, w_scale))
    assert not torch.equal(out, eager)


@pytest.mark.gpu
@needs_cuda
def test_layer_uses_the_gemv_up_to_its_row_limit_then_cublaslt():
    from pagedllm.quantization.kernels import fp8_gemv

    layer = _Layer(256, 512).cuda()
    method = fp8.Fp8LinearMethod(fp8.Fp8Scheme(serialized=True))
    limit = fp8_gemv.GEMV_MAX_ROWS
    for m, gemv in ((1, True), (limit, True), (limit + 1, False)):
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        assert fp8_ops.gemv_fits(x, layer.weight, layer.weight_scale) == gemv
        y = method.apply(layer, x, None)
        want = x.float() @ fp8_ops.dequantize_rows(layer.weight, layer.weight_scale).t()
        torch.testing.assert_close(y.float(), want, rtol=5e-2, atol=5e-2 * float(want.abs().max()))


def _act_quant_interpreter_main() -> None:
    from pagedllm.quantization.kernels import fp8_act_quant

    gen = torch.Generator().manual_seed(5)
    for rows, k, dtype in ((1, 64, torch.float32), (3, 1500, torch.float16), (4, 2048, torch.float32)):
        x = torch.randn(rows, k, generator=gen).to(dtype) * torch.tensor([1e-3, 1.0, 10.0, 0.1])[:rows, None].to(dtype)
        if rows > 2:
            x[2] = 0  # an all-zero row: the smallest scale, no 0/0
        xq, scale = fp8_act_quant.per_token_quant(x, fp8_ops.FP8_MAX, fp8_ops.MIN_SCALE)
        want_q, want_scale = fp8_ops.quantize_activations(x, None)  # the torch form on the CPU
        # Exact scales; the codes mostly equal (the interpreter's float8 rounding is not the GPU's
        # round-to-nearest-even at binade edges; the GPU test checks them bit for bit).
        assert torch.equal(scale, want_scale), (rows, k, dtype)
        assert (xq.float() == want_q.float()).float().mean() > 0.9, (rows, k, dtype)
        print("ok", rows, k, dtype)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_one_launch_activation_quantization_equals_the_torch_form_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    code = f"import runpy; runpy.run_path({__file__!r})['_act_quant_interpreter_main']()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok") == 3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_one_launch_activation_quantization_on_cuda(rows):
    """The CUDA path (one Triton launch) against the torch form on the CPU, bit for bit."""
    x = torch.randn(rows, 4096, generator=torch.Generator().manual_seed(6)).bfloat16()
    xq, scale = fp8_ops.quantize_activations(x.cuda(), None)
    want_q, want_scale = fp8_ops.quantize_activations(x, None)
    assert torch.equal(scale.cpu(), want_scale) and torch.equal(xq.cpu().float(), want_q.float())
