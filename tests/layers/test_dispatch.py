"""Every computation runs through its module (layers/custom_op.py, layers/dispatch.py, layers/compound.py).

A linear subclass that computes something else than ``F.linear(x, W, b)`` (here ``ShiftedLinear``:
``+ DELTA``, standing in for LoRA or a quantized layer) must be called on every path a model takes:
1, 2 and 3+ token rows, the pair and residual-stream forms, with the norms folded; on CUDA also the
fused paths (prologue GEMVs, the one-launch norm + qkv + RoPE + KV store, the epilogue add) and a
CUDA-graph capture. And ``prepare_model_kernels`` chooses each op's implementation once, from the
device and the ``KernelConfig``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pagedllm.config import KernelConfig
from pagedllm.layers import (
    CustomOp,
    Linear,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabEmbedding,
    fold_norms,
    prepare_model_kernels,
    triton_ops,
)
from pagedllm.models import build_model, init_dummy_weights
from tests.helpers import PagedTestRunner, tiny_config

DELTA = 0.05
CALLS: Counter = Counter()  # module name -> calls of ShiftedLinear.forward


class ShiftedLinear(Linear):
    """``F.linear(x, W, b) + DELTA``: overrides ``forward``, so it cannot honour the fused methods."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS[self.test_name] += 1
        return super().forward(x) + DELTA


def shift_linears(model: torch.nn.Module) -> list[str]:
    """Turn every linear layer of ``model`` into a ShiftedLinear of its own class; returns their names."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            module.__class__ = type(f"Shifted{type(module).__name__}", (ShiftedLinear, type(module)), {})
            module.test_name = name
            names.append(name)
    return names


def tiny_model(arch: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    return init_dummy_weights(build_model(tiny_config(arch), dtype, device), seed=3, std=0.15)


def run_steps(model, backend=None) -> list[tuple[int, Counter, torch.Tensor]]:
    """Prefill two prompts (3+ rows), decode one request (1 row), then both (2 rows): for each step
    the number of rows, the linear calls it made and its logits."""
    runner = PagedTestRunner(model, num_blocks=64, block_size=4, backend=backend)
    steps = []
    for chunks in ([(0, list(range(3, 14))), (1, list(range(20, 27)))], [(0, [100])], [(0, [101]), (1, [102])]):
        CALLS.clear()
        logits = torch.cat(runner.step(chunks))
        steps.append((sum(len(c[1]) for c in chunks), Counter(CALLS), logits))
    return steps


def assert_every_linear_called_once_per_step(steps, names) -> None:
    for rows, calls, _ in steps:
        assert calls == Counter(dict.fromkeys(names, 1)), f"{rows} rows: {calls}"


def test_a_wrapped_linear_subclass_says_it_fuses_nothing():
    assert Linear.fuses_kernels and not ShiftedLinear.fuses_kernels
    mixed = type("ShiftedQKV", (ShiftedLinear, Linear), {})
    assert not mixed.fuses_kernels
    layer = Linear(4, 3)
    layer.__class__ = mixed
    assert layer.forward_norm_prologue(torch.zeros(1, 4), None, RMSNorm(4)) is None
    assert not layer.can_fold_input_scale()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_wrapped_linear_is_called_on_every_path_on_the_cpu(arch):
    model = tiny_model(arch, torch.float32, "cpu")
    plain = run_steps(model)
    names = shift_linears(model)
    assert not fold_norms(model), "a wrapped linear is never folded (its adapter would not be scaled)"
    prepare_model_kernels(model, torch.device("cpu"), KernelConfig())
    pair = run_steps(model)
    assert_every_linear_called_once_per_step(pair, names)
    assert all(not torch.allclose(p[2], q[2]) for p, q in zip(plain, pair)), "the shift must show"
    # The residual-stream form, forced on (CUDA-only in the engine, and never with such a linear:
    # its shift does not commute with the norm's row scale applied after it, as a bias would not,
    # which is why fold_norms refuses it): the 3+ row prefill takes it, the decodes the pair form.
    model.model.residual.use_stream_from(3)
    stream = run_steps(model)
    assert_every_linear_called_once_per_step(stream, names)
    assert not torch.allclose(stream[0][2], pair[0][2]), "the prefill must have taken the stream form"


def test_wrapped_linear_is_called_on_every_path_with_the_norms_folded():
    model = tiny_model("llama", torch.float32, "cpu")
    with torch.no_grad():  # non-trivial norm weights, so that folding changes the weights
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight"):
                param.copy_(torch.rand(param.shape, generator=torch.Generator().manual_seed(7)) + 0.5)
    unfolded = run_steps(model)
    assert fold_norms(model)
    names = shift_linears(model)  # wrapped after folding: the folded weights stay its weights
    model.model.residual.use_stream_from(3)
    folded = run_steps(model)
    assert_every_linear_called_once_per_step(folded, names)
    assert all(not torch.allclose(p[2], q[2]) for p, q in zip(unfolded, folded)), "the shift must show"


def test_prepare_chooses_each_implementation_once_on_the_cpu():
    model = tiny_model("qwen3", torch.float32, "cpu")
    fresh = {type(m).__name__: m.impl for m in model.modules() if isinstance(m, CustomOp)}
    assert set(fresh.values()) == {"cpu"}, "a fresh module runs its CPU form"
    plan = prepare_model_kernels(model, torch.device("cpu"), KernelConfig())
    kinds = {(type(m).__name__, m.impl) for m in model.modules() if isinstance(m, CustomOp)}
    assert kinds == {(name, "cpu") for name in ("QKVLinear", "RowParallelLinear", "MergedLinear", "RMSNorm", "SiluAndMul",
                                                "RotaryEmbedding", "VocabEmbedding", "LMHead")}
    assert plan.impls["model.layers.0.self_attn.qkv_proj"] == "cpu" and plan.impls["lm_head"] == "cpu"
    assert plan.packed_weights > 0 and not plan.norms_folded and model.model.residual.stream_min_tokens is None
    # Without the C kernels the ops run their torch code; oneDNN's prepacked GEMM stays.
    prepare_model_kernels(model, torch.device("cpu"), KernelConfig(cpu_kernels=False))
    impls = {type(m): m.impl for m in model.modules() if isinstance(m, CustomOp)}
    assert impls[RMSNorm] == impls[SiluAndMul] == impls[RotaryEmbedding] == impls[VocabEmbedding] == "native"
    assert impls[RowParallelLinear] == impls[LMHead] == "cpu"


def test_prepare_for_cuda_follows_the_kernel_config(monkeypatch):
    """The choice alone (no CUDA needed): the fused kernels where allowed, and the norms folded and
    the residual-stream form on only with both fold_norms and the fused kernels."""
    monkeypatch.setattr(triton_ops, "HAS_TRITON", True)
    cuda = torch.device("cuda")
    model = tiny_model("llama", torch.float32, "cpu")
    plan = prepare_model_kernels(model, cuda, KernelConfig())
    assert plan.norms_folded and model.model.residual.stream_min_tokens == plan.tuning.residual_stream_min_tokens
    assert {m.impl for m in model.modules() if isinstance(m, CustomOp)} == {"cuda"}
    model = tiny_model("llama", torch.float32, "cpu")
    plan = prepare_model_kernels(model, cuda, KernelConfig(fused_ops=False))
    assert plan.norms_folded and model.model.residual.stream_min_tokens is None
    impls = {type(m): m.impl for m in model.modules() if isinstance(m, CustomOp)}
    assert impls[RowParallelLinear] == impls[LMHead] == "cublas" and impls[RMSNorm] == "native"
    model = tiny_model("qwen2", torch.float32, "cpu")  # q/k/v biases: nothing to fold
    plan = prepare_model_kernels(model, cuda, KernelConfig())
    assert not plan.norms_folded and model.model.residual.stream_min_tokens is None


# ---- CUDA: the fused paths and a graph (the lead runs these on a GPU) ----------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_ops.HAS_TRITON), reason="needs Triton and CUDA")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_wrapped_linear_is_called_on_every_path_on_cuda(arch):
    """Batch 1 (where plain linears take the one-launch norm + qkv + RoPE + KV store and the prologue
    GEMVs), batch 2, the 3+ row residual-stream form with the norms folded before wrapping, and a
    captured batch-1 decode graph whose replay equals the eager step."""
    from pagedllm.attention.triton_backend import TritonBackend

    model = tiny_model(arch, torch.bfloat16, "cuda")
    plain = prepare_model_kernels(model, torch.device("cuda"), KernelConfig())
    assert plain.norms_folded
    names = shift_linears(model)
    prepare_model_kernels(model, torch.device("cuda"), KernelConfig(fold_norms=False))
    model.model.residual.use_stream_from(plain.tuning.residual_stream_min_tokens)
    steps = run_steps(model, backend=TritonBackend())
    assert_every_linear_called_once_per_step(steps, names)
    assert all(torch.isfinite(s[2]).all() for s in steps)
    # A batch-1 decode forward, captured in a CUDA graph: the wrapped linears are in the graph.
    from tests.helpers import capture_batch1_decode

    graph, out, eager = capture_batch1_decode(model, TritonBackend(), before_capture=CALLS.clear)
    assert CALLS == Counter(dict.fromkeys(names, 1))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=2e-2, atol=2e-2)
