"""Invalid sampling values raise ValueError whose message starts with the field's name (vLLM ranges),
at SamplingParams construction or, for limits that depend on the model, at add_request."""

from __future__ import annotations

import pytest

from pagedllm import LLM, BeamSearchParams, SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": 2.01}, "frequency_penalty"),
    ({"top_k": -5}, "top_k"),
    ({"top_p": -0.1}, "top_p"),
    ({"best_of": 0}, "best_of"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"logprobs": "5"}, "logprobs"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": "x", "detokenize": False}, "stop"),
    ({"allowed_token_ids": [3, -4]}, "allowed_token_ids"),
    ({"logit_bias": {-3: 1.0}}, "logit_bias"),
    ({"seed": 1.5}, "seed"),
    ({"max_tokens": -3}, "max_tokens"),
])
def test_invalid_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(field), str(e.value)


def test_valid_edge_values_are_accepted():
    SamplingParams(top_k=-1, top_p=1.0, min_p=1.0, temperature=0.0, repetition_penalty=0.01,
                   presence_penalty=-2.0, frequency_penalty=2.0, logprobs=0, prompt_logprobs=0, n=3, best_of=3)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from tests.helpers import make_tiny_model

    return LLM(make_tiny_model("llama", tmp_path_factory.mktemp("llama")), dtype="float32", max_logprobs=6)


@pytest.mark.parametrize("kwargs, field", [
    ({"logprobs": 7}, "logprobs"),
    ({"prompt_logprobs": 9}, "prompt_logprobs"),
    ({"allowed_token_ids": [5, 49152]}, "allowed_token_ids"),
    ({"logit_bias": {10**6: 2.0}}, "logit_bias"),
    ({"stop_token_ids": [49152]}, "stop_token_ids"),
])
def test_model_dependent_limits_name_the_field(llm, kwargs, field):
    with pytest.raises(ValueError) as e:
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(**kwargs), use_tqdm=False)
    assert str(e.value).startswith(field), str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_beam_width_limited_by_max_logprobs(llm):
    with pytest.raises(ValueError, match="^beam_width"):
        llm.beam_search([{"prompt_token_ids": [5, 6]}], BeamSearchParams(beam_width=4, max_tokens=2))
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search([{"prompt_token_ids": [5, 6]}], SamplingParams())


def test_caller_params_are_not_modified(llm):
    params = SamplingParams(bad_words=["hello"], max_tokens=2)
    llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
    llm.llm_engine.add_request("x", {"prompt_token_ids": [5, 6, 7]}, params)
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    assert params._bad_words_token_ids is None and params._eos_token_id is None
