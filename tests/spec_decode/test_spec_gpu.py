"""Speculative decoding on CUDA (skipped without it): greedy outputs equal those without drafts,
with the decode CUDA graphs on for the plain steps and async scheduling on (the GPU defaults)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.helpers import make_tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_outputs_equal_on_cuda(tmp_path, method):
    target = make_tiny_model("llama", tmp_path / "t")
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
            if method == "ngram" else {"method": "draft_model", "model": target, "num_speculative_tokens": 3})
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8, 5 + i, 6, 7] * (1 + i % 3)} for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = {}
    for name, config in (("plain", None), ("spec", spec)):
        llm = LLM(target, dtype="float32", max_model_len=256, max_num_seqs=8, gpu_memory_utilization=0.3,
                  speculative_config=config)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.llm_engine.engine_core.scheduler.stats().spec_decoding
        llm.llm_engine.shutdown()
    assert outs["spec"] == outs["plain"]
    assert stats is not None and stats.num_accepted_tokens > 0
