"""A quantized linear is called on every path a model takes (as tests/layers/test_dispatch.py shows
for a wrapped linear): 1, 2 and 3+ token rows, the pair and the residual-stream forms, with the
norms folded into the layers that stay float; on CUDA also where plain layers take the fused GEMVs,
the one-launch norm + qkv + RoPE + KV store, the epilogue add, and a captured decode graph."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pagedllm.config import KernelConfig
from pagedllm.layers import CustomOp, Linear, fold_norms, prepare_model_kernels, triton_ops
from pagedllm.models import build_model, init_dummy_weights
from pagedllm.quantization.fp8 import Fp8Config, Fp8LinearMethod
from tests.helpers import PagedTestRunner, tiny_config

# layer name -> products by Fp8LinearMethod: ``apply`` calls, and the fused kernels it ran
# (``apply_norm_prologue`` / ``apply_act_prologue`` / ``apply_norm_qkv_rope_store`` calls that did not
# decline with None).
CALLS: Counter = Counter()


@pytest.fixture(autouse=True)
def count_apply_calls(monkeypatch):
    for name in ("apply", "apply_norm_prologue", "apply_act_prologue", "apply_norm_qkv_rope_store"):
        method = getattr(Fp8LinearMethod, name)

        def counted(self, layer, *args, method=method):
            out = method(self, layer, *args)
            CALLS[layer.test_name] += out is not None
            return out

        monkeypatch.setattr(Fp8LinearMethod, name, counted)


def fp8_model(arch: str, dtype: torch.dtype, device: str, quant_config=None) -> tuple[torch.nn.Module, list[str]]:
    model = build_model(tiny_config(arch), dtype, device, quant_config or Fp8Config.online())
    init_dummy_weights(model, seed=3, std=0.15)
    names = []
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.quant_method is not None:
            module.test_name = name
            names.append(name)
    return model, names


def run_steps(model, backend=None) -> list[tuple[int, Counter, torch.Tensor]]:
    """Prefill two prompts (3+ rows), decode one request (1 row), then both (2 rows), then prefill two
    more prompts in one step of 40 rows (FP8's batch rows on CUDA)."""
    runner = PagedTestRunner(model, num_blocks=64, block_size=4, backend=backend)
    steps = []
    for chunks in ([(0, list(range(3, 14))), (1, list(range(20, 27)))], [(0, [100])], [(0, [101]), (1, [102])],
                   [(2, list(range(30, 60))), (3, list(range(5, 15)))]):
        CALLS.clear()
        logits = torch.cat(runner.step(chunks))
        steps.append((sum(len(c[1]) for c in chunks), Counter(CALLS), logits))
    return steps


def assert_every_quantized_linear_called_once_per_step(steps, names) -> None:
    assert names
    for rows, calls, _ in steps:
        assert calls == Counter(dict.fromkeys(names, 1)), f"{rows} rows: {calls}"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_quantized_linears_are_called_on_every_path_on_the_cpu(arch):
    model, names = fp8_model(arch, torch.float32, "cpu")
    assert len(names) == 4 * model.config.num_hidden_layers
    assert not fold_norms(model), "a quantized linear's weight cannot take the norm"
    plan = prepare_model_kernels(model, torch.device("cpu"), KernelConfig())
    assert {plan.impls[n] for n in names} == {"quantized"}
    assert all(m.cpu_packed_weight is None for m in model.modules() if isinstance(m, Linear))
    pair = run_steps(model)
    assert_every_quantized_linear_called_once_per_step(pair, names)
    model.model.residual.use_stream_from(3)  # forced on (CUDA-only in the engine)
    stream = run_steps(model)
    assert_every_quantized_linear_called_once_per_step(stream, names)
    for p, s in zip(pair, stream):
        torch.testing.assert_close(s[2], p[2], rtol=1e-4, atol=1e-4)


def test_quantized_output_projections_under_folded_norms_and_the_stream_form():
    """qkv and gate_up stay float (the checkpoint's ignore list), so the norms fold into them and
    the stream form runs; the quantized o_proj (epilogue add) and down_proj (activation prologue)
    must still be called on every path."""
    ignored = [f"model.layers.{i}.{p}" for i in range(3) for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")]
    model, names = fp8_model("llama", torch.float32, "cpu", Fp8Config(Fp8Config.online().scheme, ignored))
    assert sorted({n.rsplit(".", 1)[1] for n in names}) == ["down_proj", "o_proj"]
    with torch.no_grad():  # non-trivial norm weights, so that folding changes the weights
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight"):
                param.copy_(torch.rand(param.shape, generator=torch.Generator().manual_seed(7)) + 0.5)
    unfolded = run_steps(model)
    assert fold_norms(model)
    model.model.residual.use_stream_from(3)
    folded = run_steps(model)
    assert_every_quantized_linear_called_once_per_step(folded, names)
    for u, f in zip(unfolded, folded):
        torch.testing.assert_close(f[2], u[2], rtol=1e-3, atol=1e-3)


def test_prepare_for_cuda_keeps_quantized_linears_off_the_fused_and_tuned_paths(monkeypatch):
    monkeypatch.setattr(triton_ops, "HAS_TRITON", True)
    model, names = fp8_model("llama", torch.float32, "cpu")
    plan = prepare_model_kernels(model, torch.device("cuda"), KernelConfig())
    assert not plan.norms_folded and model.model.residual.stream_min_tokens is None
    impls = {type(m).__name__: m.impl for m in model.modules() if isinstance(m, CustomOp)}
    assert {impls[k] for k in ("QKVLinear", "MergedLinear", "RowParallelLinear")} == {"quantized"}
    assert impls["RMSNorm"] == impls["LMHead"] == "cuda"
    tuned = [m for m in model.modules() if getattr(m, "gemm_tunable", False)]
    assert tuned == [model.lm_head], "the cuBLAS table times float weights only"


def test_unquantized_linears_are_untouched():
    model = init_dummy_weights(build_model(tiny_config("llama"), torch.float32, "cpu"), seed=3)
    linear = model.model.layers[0].mlp.down_proj
    assert linear.quant_method is None and linear.fuses_kernels and linear.gemm_tunable
    assert "fuses_kernels" not in vars(linear) and "gemm_tunable" not in vars(linear)
    plan = prepare_model_kernels(model, torch.device("cpu"), KernelConfig())
    assert plan.impls["model.layers.0.mlp.down_proj"] == "cpu" and linear.cpu_packed_weight is not None


# ---- CUDA (the lead runs these on a GPU) -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_ops.HAS_TRITON), reason="needs Triton and CUDA")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_quantized_linears_are_called_on_every_path_on_cuda(arch):
    """bf16 on CUDA with the fused kernels on: batch 1, 2 and 3+ rows, then a captured batch-1
    decode graph whose replay equals the eager step; the FP8 logits stay near the float model's."""
    from pagedllm.attention.triton_backend import TritonBackend
    from tests.helpers import capture_batch1_decode

    model, names = fp8_model(arch, torch.bfloat16, "cuda")
    prepare_model_kernels(model, torch.device("cuda"), KernelConfig())
    steps = run_steps(model, backend=TritonBackend())
    assert_every_quantized_linear_called_once_per_step(steps, names)
    float_model = init_dummy_weights(build_model(tiny_config(arch), torch.bfloat16, "cuda"), seed=3, std=0.15)
    prepare_model_kernels(float_model, torch.device("cuda"), KernelConfig())
    # On CUDA the activations are quantized per token too: e4m3's 3 mantissa bits in every linear
    # of this random model put the logits ~14% (mean relative) from the float model's on an H100.
    # The bound is there to catch a wrong scale or layout, not to measure rounding.
    for (_, _, got), (_, _, want) in zip(steps, run_steps(float_model, backend=TritonBackend())):
        assert torch.isfinite(got).all()
        assert float((got.float() - want.float()).abs().mean()) < 0.25 * float(want.float().abs().mean())

    graph, out, eager = capture_batch1_decode(model, TritonBackend(), before_capture=CALLS.clear)
    assert CALLS == Counter(dict.fromkeys(names, 1))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=2e-2, atol=2e-2)
