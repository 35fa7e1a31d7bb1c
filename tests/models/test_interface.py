"""The model interface the runner relies on (models/interface.py) and the one architecture table
(loader/architectures.py) that both the loader and the model registry read."""

import pytest
import torch

from pagedllm.loader.architectures import ARCHITECTURES, architecture_for, gguf_permutes_qk
from pagedllm.models import LlamaForCausalLM, build_model, get_model_class, supported_architectures
from pagedllm.models.interface import CausalLM, check_model, check_model_class
from pagedllm.models.moe import MoeForCausalLM
from tests.helpers import tiny_config
from tests.models.moe_tiny import MOE_ARCHS, tiny_moe_config


def test_llama_provides_the_interface():
    check_model_class(LlamaForCausalLM)
    model = build_model(tiny_config("llama"), torch.float32, "cpu")
    check_model(model)
    assert isinstance(model, CausalLM)


def test_a_class_lacking_a_member_is_refused():
    class NoLogits(torch.nn.Module):
        config = None
        max_supported_len = None

        def forward(self, input_ids, positions):
            return input_ids

    with pytest.raises(TypeError, match="compute_logits"):
        check_model_class(NoLogits)


def test_one_table_serves_registry_and_loader():
    assert supported_architectures() == sorted(a.hf_class for a in ARCHITECTURES.values())
    for arch in (a for a in ARCHITECTURES.values() if not a.is_encoder):  # encoders: test_embedding_models.py
        moe = arch.model_type in MOE_ARCHS
        cfg = tiny_moe_config(arch.model_type) if moe else tiny_config(arch.model_type)
        cfg.architectures = [arch.hf_class]
        assert get_model_class(cfg) is (MoeForCausalLM if moe else LlamaForCausalLM)
        assert architecture_for(None, arch.model_type) is arch  # GGUF configs: model_type only
    assert architecture_for(["NopeForCausalLM"], "nope") is None
    assert gguf_permutes_qk("llama") and not gguf_permutes_qk("qwen2") and not gguf_permutes_qk("unknown")
