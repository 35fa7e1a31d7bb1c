"""The PDL switch (pagedllm/pdl.py): off by default, on only while a batch-1 decode graph is
captured, and never where it cannot work (CPU tensors, Triton's interpreter, PAGEDLLM_PDL=0)."""

import torch

from pagedllm import pdl


def test_off_by_default_and_on_only_for_one_token_graphs():
    assert not pdl._Switch.enabled
    with pdl.for_graph(1):
        assert pdl._Switch.enabled
    with pdl.for_graph(pdl.MAX_TOKENS + 1):
        assert not pdl._Switch.enabled
    assert not pdl._Switch.enabled  # restored on exit
    with pdl.for_graph(1, allowed=False):  # KernelConfig.pdl off (PAGEDLLM_PDL=0)
        assert not pdl._Switch.enabled


def test_launch_kwargs_off_the_gpu():
    with pdl.pdl(True):
        assert pdl.launch_kwargs(torch.device("cpu")) == {"USE_PDL": False}
        assert not pdl.pdl_enabled(torch.device("cpu"))


def test_interpreter_never_uses_pdl(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pdl.pdl(True):
        assert not pdl.pdl_enabled(torch.device("cuda", 0))
