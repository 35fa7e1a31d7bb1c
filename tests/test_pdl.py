"""The PDL switch (pagedllm/pdl.py): where the runner turns it on, and that it stays off where it
cannot work (CPU tensors, Triton's interpreter, PAGEDLLM_PDL=0)."""

import torch

from pagedllm import pdl


def test_for_tokens_turns_pdl_on_only_for_one_token_forwards():
    with pdl.pdl(True):
        with pdl.for_tokens(1):
            assert pdl._Switch.enabled
        with pdl.for_tokens(pdl.MAX_TOKENS + 1):
            assert not pdl._Switch.enabled
        assert pdl._Switch.enabled  # restored on exit
    with pdl.pdl(False), pdl.for_tokens(1):  # PAGEDLLM_PDL=0 keeps it off everywhere
        assert not pdl._Switch.enabled


def test_launch_kwargs_off_the_gpu():
    with pdl.pdl(True):
        assert pdl.launch_kwargs(torch.device("cpu")) == {"USE_PDL": False}
        assert not pdl.pdl_enabled(torch.device("cpu"))


def test_interpreter_never_uses_pdl(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pdl.pdl(True):
        assert not pdl.pdl_enabled(torch.device("cuda", 0))
