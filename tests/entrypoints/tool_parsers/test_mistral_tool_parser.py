"""The mistral parser: [TOOL_CALLS] and a JSON list of calls to the end of the reply."""

import pytest

from pagedllm.entrypoints.openai.tool_parsers import MistralToolParser
from tests.entrypoints.tool_parsers.stream_replay import replay, without_ids

TEXT = ('Checking both.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]')


def test_calls_after_the_marker_and_content_before_it():
    result = MistralToolParser().extract_tool_calls(TEXT)
    assert [c["function"] for c in result.tool_calls] == [
        {"name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"name": "get_time", "arguments": '{"tz":"Europe/Paris"}'}]
    assert result.content == "Checking both."


def test_unparsable_calls_are_content():
    text = "[TOOL_CALLS] get_weather(city='Paris')"
    result = MistralToolParser().extract_tool_calls(text)
    assert not result.tools_called and result.content == text


@pytest.mark.parametrize("seed", range(4))
def test_streaming_reassembles(seed):
    expected = MistralToolParser().extract_tool_calls(TEXT)
    _, content, tool_calls = replay(MistralToolParser(), TEXT, seed)
    assert content == expected.content and without_ids(tool_calls) == without_ids(expected.tool_calls)
