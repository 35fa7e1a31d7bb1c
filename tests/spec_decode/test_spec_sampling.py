"""Speculation changes no request's output: seeded sampling with every sampling knob, logprobs of
the accepted tokens, min_tokens, and a grammar (structured output) give the same tokens with and
without drafts, in synchronous and asynchronous scheduling. A draft model equal to the target
drafts each step's most likely tokens, so sampled requests see drafts accepted and rejected."""

from __future__ import annotations

import re

import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from tests.helpers import make_tiny_model

pytestmark = pytest.mark.slow

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [300, 301, 5, 6]},
           {"prompt_token_ids": [42] * 9}]
REGEX = r"[0-9]{3}-[a-z]{2,4}"


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    target = make_tiny_model("llama", tmp_path_factory.mktemp("t"))
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    built = {}

    def get(speculative: bool, async_scheduling: bool = False) -> LLM:
        key = (speculative, async_scheduling)
        if key not in built:
            built[key] = LLM(target, max_model_len=128, max_num_seqs=4, async_scheduling=async_scheduling,
                             speculative_config=spec if speculative else None)
        return built[key]

    return get


def outputs(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, seed=7, max_tokens=16, top_k=50, top_p=0.95, min_p=0.01,
                   presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                   logit_bias={17: 3.0, 18: -100.0}, min_tokens=4),
    SamplingParams(temperature=0.0, max_tokens=16, logprobs=3, repetition_penalty=1.3),
], ids=["seeded_sampling", "greedy_logprobs"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_same_output_with_and_without_drafts(engines, params, async_scheduling):
    plain = outputs(engines(False), params)
    spec_llm = engines(True, async_scheduling)
    ours = outputs(spec_llm, params)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(ours, plain):
        assert tokens == ref_tokens
        if ref_logprobs is not None:
            assert len(logprobs) == len(tokens)
            for mine, ref in zip(logprobs, ref_logprobs):
                assert mine.keys() == ref.keys()
                assert all(abs(mine[t].logprob - ref[t].logprob) < 1e-4 for t in ref)
    stats = spec_llm.llm_engine.engine_core.scheduler.stats().spec_decoding
    assert stats.num_accepted_tokens > 0
    if params.temperature > 0:
        assert stats.num_accepted_tokens < stats.num_draft_tokens, "at temperature 0.9 some drafts are rejected"


def test_structured_output_with_drafts(engines):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    plain = engines(False).generate(PROMPTS, params, use_tqdm=False)
    ours = engines(True).generate(PROMPTS, params, use_tqdm=False)
    for o, r in zip(ours, plain):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        assert re.fullmatch(REGEX, o.outputs[0].text), o.outputs[0].text
