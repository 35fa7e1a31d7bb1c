"""StructuredOutputsParams: exactly one constraint, each of its type, refused fields named."""

from __future__ import annotations

import pickle

import pytest

from pagedllm import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("kwargs, kind", [
    ({"json": {"type": "object"}}, "json"),
    ({"json": '{"type": "object"}'}, "json"),
    ({"regex": "a+"}, "regex"),
    ({"choice": ["a", "b"]}, "choice"),
    ({"grammar": 'root ::= "a"'}, "grammar"),
    ({"json_object": True}, "json_object"),
])
def test_each_kind_alone_is_accepted(kwargs, kind):
    params = StructuredOutputsParams(**kwargs)
    assert params.kind == kind
    sp = SamplingParams(structured_outputs=params)
    assert pickle.loads(pickle.dumps(sp)).structured_outputs == params  # crosses to an engine process


@pytest.mark.parametrize("kwargs, field", [
    ({}, "structured_outputs"),
    ({"json": {"type": "object"}, "regex": "a"}, "structured_outputs"),
    ({"json": 5}, "json"),
    ({"regex": ""}, "regex"),
    ({"grammar": 3}, "grammar"),
    ({"choice": []}, "choice"),
    ({"choice": "ab"}, "choice"),
    ({"choice": ["a", 1]}, "choice"),
    ({"json_object": False}, "structured_outputs"),
    ({"json_object": 1, "disable_any_whitespace": False}, "json_object"),
    ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace"),
    ({"regex": "a", "whitespace_pattern": r"\s*"}, "whitespace_pattern"),
])
def test_bad_fields_are_refused_by_name(kwargs, field):
    with pytest.raises((ValueError, TypeError)) as e:
        StructuredOutputsParams(**kwargs)
    assert str(e.value).startswith(field)


def test_sampling_params_refuses_a_dict_for_structured_outputs():
    with pytest.raises(TypeError, match="^structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})


def test_cache_key_is_the_same_for_a_schema_dict_and_its_text():
    a = StructuredOutputsParams(json={"b": 1, "a": 2}).cache_key()
    assert a == StructuredOutputsParams(json={"a": 2, "b": 1}).cache_key()
    assert a == StructuredOutputsParams(json='{"a": 2,  "b": 1}').cache_key()
    assert a != StructuredOutputsParams(json={"a": 2, "b": 1}, disable_any_whitespace=True).cache_key()
    assert StructuredOutputsParams(choice=["x"]).cache_key() != StructuredOutputsParams(regex="x").cache_key()
