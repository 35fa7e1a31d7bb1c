"""pagedllm.models: our model implementations and the registry that picks one for a config."""

from pagedllm.models.interface import CausalLM
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.registry import (
    build_model,
    get_model_class,
    init_dummy_weights,
    load_model,
    max_supported_len,
    supported_architectures,
)

__all__ = [
    "CausalLM",
    "LlamaForCausalLM",
    "build_model",
    "get_model_class",
    "init_dummy_weights",
    "load_model",
    "max_supported_len",
    "supported_architectures",
]
