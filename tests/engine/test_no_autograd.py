"""A step must never record autograd history: the KV cache is written in place every step, so
history would chain every step's activations to the cache and grow memory without bound."""

import torch

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from tests.helpers import make_tiny_model


def test_steps_record_no_autograd_history(tmp_path):
    engine = LLMEngine.from_engine_args(EngineArgs(model=make_tiny_model("llama", tmp_path), dtype="float32"))
    engine.add_request("r", {"prompt_token_ids": list(range(5, 60))}, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    for cache in engine.engine_core.runner.kv_caches:
        assert cache.grad_fn is None and not cache.requires_grad
    assert torch.count_nonzero(engine.engine_core.runner.kv_caches[0]) > 0, "the KV cache was written"
