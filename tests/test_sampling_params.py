import pytest

from pagedllm.sampling_params import RequestOutputKind, SamplingParams, SamplingType


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"temperature": "hot"}, "temperature"),
        ({"n": 1.5}, "n"),
        ({"seed": "s"}, "seed"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(field), str(e.value)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="x", top_k=-1, temperature=0.0, top_p=0.5)
    assert p.stop == ["x"] and p.stop_token_ids == [] and p.top_k == 0
    assert p.sampling_type == SamplingType.GREEDY and p.top_p == 1.0  # greedy ignores the nucleus
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams().max_tokens == 16 and SamplingParams().output_kind == RequestOutputKind.CUMULATIVE
    assert SamplingParams(logit_bias={"5": "1.5"}).logit_bias == {5: 1.5}


def test_verify_vocab():
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[10**7]).verify_vocab(1000)
