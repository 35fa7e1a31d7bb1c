"""Defaults that create_engine_config fills in: the token budget by device and usage context."""

from types import SimpleNamespace

import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.engine import config_builder
from pagedllm.engine.config_builder import create_engine_config, default_max_num_batched_tokens
from tests.helpers import make_tiny_model


def _gpu(monkeypatch, name: str, gib: int) -> None:
    props = SimpleNamespace(name=name, total_memory=gib * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)


def test_cpu_budget_is_2048_whoever_asks():
    for usage in config_builder.USAGE_CONTEXTS:
        assert default_max_num_batched_tokens("cpu", usage) == 2048


@pytest.mark.parametrize(
    "name,gib,usage,expected",
    [
        ("NVIDIA H200", 141, "LLM_CLASS", 16384),  # vLLM's LLM-class default on H100/H200
        ("NVIDIA H100 80GB HBM3", 80, "LLM_CLASS", 16384),
        ("NVIDIA H200", 141, "OPENAI_API_SERVER", 8192),
        ("NVIDIA H200", 141, "ENGINE_CONTEXT", 8192),
        ("NVIDIA A100-SXM4-80GB", 80, "LLM_CLASS", 8192),  # A100 keeps the smaller budget
        ("NVIDIA L4", 24, "LLM_CLASS", 8192),
    ],
)
def test_gpu_budget_by_size_name_and_usage(monkeypatch, name, gib, usage, expected):
    _gpu(monkeypatch, name, gib)
    assert default_max_num_batched_tokens("cuda:0", usage) == expected


def test_unknown_usage_context_is_refused():
    with pytest.raises(ValueError, match="usage_context"):
        create_engine_config(EngineArgs(), usage_context="llm")


def test_explicit_budget_wins_and_cpu_default_applies(tmp_path):
    folder = make_tiny_model("llama", tmp_path)
    cfg = create_engine_config(EngineArgs(model=folder, device="cpu"), usage_context="LLM_CLASS")
    assert cfg.scheduler_config.max_num_batched_tokens == 2048
    cfg = create_engine_config(EngineArgs(model=folder, device="cpu", max_num_batched_tokens=512))
    assert cfg.scheduler_config.max_num_batched_tokens == 512


def test_packed_gguf_under_tensor_parallel_is_planned():
    """The embedded SmolLM2 (9 heads, 3 KV heads) divides by 3, and each rank keeps its slice of the
    packed blocks (loader/gguf_file.GGUFSlice): packed and dequantized alike are planned."""
    config = create_engine_config(EngineArgs(tensor_parallel_size=3))
    assert config.parallel_config.tensor_parallel_size == 3 and config.model_config.quant_config.name == "gguf"
    config = create_engine_config(EngineArgs(tensor_parallel_size=3, load_format="gguf_dequantized"))
    assert config.parallel_config.tensor_parallel_size == 3 and config.model_config.quant_config is None
