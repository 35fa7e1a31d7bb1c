"""The llama3_json parser: {"name", "parameters"} objects at the start of a reply, ';'-separated."""

import pytest

from pagedllm.entrypoints.openai.tool_parsers import Llama3JsonToolParser
from tests.entrypoints.tool_parsers.stream_replay import replay, without_ids

ONE = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
TWO = '{"name": "get_time", "parameters": {"tz": "UTC"}}'


@pytest.mark.parametrize("text", [ONE, f"<|python_tag|>{ONE}", f"\n{ONE}; {TWO}"])
def test_calls_at_the_start_of_the_reply(text):
    result = Llama3JsonToolParser().extract_tool_calls(text)
    assert result.tools_called and result.content is None
    assert result.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert len(result.tool_calls) == text.count('"name"')


@pytest.mark.parametrize("text", [f"Calling {ONE}", "{not json}", f"{ONE} and some words", "<|py"])
def test_anything_else_is_content(text):
    result = Llama3JsonToolParser().extract_tool_calls(text)
    assert not result.tools_called and result.content == text.removeprefix("<|python_tag|>")


@pytest.mark.parametrize("text", [f"<|python_tag|>{ONE}; {TWO}", f"{ONE};{TWO};{ONE}; {TWO}", f"Calling {ONE}",
                                  "Hello there", "<|py"])
@pytest.mark.parametrize("seed", range(4))
def test_streaming_reassembles(text, seed):
    expected = Llama3JsonToolParser().extract_tool_calls(text)
    _, content, tool_calls = replay(Llama3JsonToolParser(), text, seed)
    assert content == expected.content and without_ids(tool_calls) == without_ids(expected.tool_calls)
