"""The worker's start-up GEMM library choice (Worker._tune_gemms -> KernelPlan.tune_gemms): which
weights and batch sizes it hands to the plan's GemmLibrary.tune, and the gemm-tuning switch. CPU only: the timing itself is covered by the GPU tests in
tests/layers/test_gemm_library.py."""

from types import SimpleNamespace

import torch
from torch import nn

from pagedllm.config import KernelConfig
from pagedllm.layers import prepare_model_kernels, triton_ops
from pagedllm.layers.embedding import LMHead
from pagedllm.layers.gemm_library import GemmLibrary
from pagedllm.layers.linear import Linear, MergedLinear
from pagedllm.worker.worker import Worker


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)  # not a linear layer: never timed
        self.proj = Linear(8, 16)
        self.gate_up = MergedLinear(8, [12, 12])
        self.lm_head = LMHead(32, 8)


def run(monkeypatch, env: str | None):
    calls = []
    monkeypatch.setattr(GemmLibrary, "tune", lambda self, weights, rows, skip=None: calls.append(
        (list(weights), list(rows), skip)) or {"measured": 0, "cublaslt": 0, "seconds": 0.0})
    monkeypatch.setattr(triton_ops, "HAS_TRITON", True)
    if env is None:
        monkeypatch.delenv("PAGEDLLM_GEMM_TUNING", raising=False)
    else:
        monkeypatch.setenv("PAGEDLLM_GEMM_TUNING", env)
    model = TinyModel()
    config = SimpleNamespace(kernel_config=KernelConfig.from_env())  # the switch is read at config build
    plan = prepare_model_kernels(model, torch.device("cuda"), config.kernel_config)
    Worker._tune_gemms(SimpleNamespace(model=model, config=config, kernel_plan=plan), [1, 2, 8, 16])
    return model, calls


def test_every_linear_and_the_lm_head_are_timed_at_the_graph_sizes(monkeypatch):
    model, calls = run(monkeypatch, None)
    assert len(calls) == 1
    weights, rows, skip = calls[0]
    assert {id(w) for w in weights} == {id(model.proj.weight), id(model.gate_up.weight), id(model.lm_head.weight)}
    assert rows == [1, 2, 8, 16]
    # Calls that never reach cuBLAS are skipped: the Triton GEMV's, and the LM head's where it takes one.
    x = torch.zeros(1, 8)
    monkeypatch.setattr(triton_ops, "skinny_gemm_fits", lambda x, w, tuning: w is model.proj.weight)
    monkeypatch.setattr(triton_ops, "skinny_lm_head_fits", lambda x, w: True)
    assert skip(x, model.proj.weight) and skip(x, model.lm_head.weight) and not skip(x, model.gate_up.weight)
    monkeypatch.setattr(triton_ops, "skinny_lm_head_fits", lambda x, w: False)
    assert not skip(x, model.lm_head.weight)


def test_the_switch_turns_the_timing_off(monkeypatch):
    assert run(monkeypatch, "0")[1] == []
    assert len(run(monkeypatch, "1")[1]) == 1
