"""The pythonic parser: the reply is a Python list of calls with literal keyword arguments."""

import json

import pytest

from pagedllm.entrypoints.openai.tool_parsers import PythonicToolParser
from tests.entrypoints.tool_parsers.stream_replay import replay, without_ids

TEXT = "[get_weather(city='Paris', days=2, hourly=True), get_time(), tag(names=['a', \"b\"], extra=None)]"


@pytest.mark.parametrize("text", [TEXT, f"<|python_start|>{TEXT}<|python_end|>"])
def test_a_list_of_calls(text):
    result = PythonicToolParser().extract_tool_calls(text)
    assert result.tools_called and result.content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2, "hourly": True}), ("get_time", {}),
        ("tag", {"names": ["a", "b"], "extra": None})]
    assert result.tool_calls[0]["function"]["arguments"] == '{"city":"Paris","days":2,"hourly":true}'


@pytest.mark.parametrize("text", ["The answer is 4.", "[1, 2]", "[f(x)]", "[f(a=g())]", "[f(**kw)]",
                                  "[obj.f(a=1)]", "[f(a=1)", "[f(a={1, 2})]"])
def test_anything_else_is_content(text):
    result = PythonicToolParser().extract_tool_calls(text)
    assert not result.tools_called and result.content == text


@pytest.mark.parametrize("text", [TEXT, "The answer is 4.", "[f(a=1)"])
@pytest.mark.parametrize("seed", range(4))
def test_streaming_reassembles(text, seed):
    expected = PythonicToolParser().extract_tool_calls(text)
    _, content, tool_calls = replay(PythonicToolParser(), text, seed)
    assert content == expected.content and without_ids(tool_calls) == without_ids(expected.tool_calls)
