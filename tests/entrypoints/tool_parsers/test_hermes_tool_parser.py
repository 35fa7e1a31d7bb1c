"""The hermes parser: <tool_call>{"name", "arguments"}</tool_call> blocks, whole and streamed."""

import json

import pytest

from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser
from tests.entrypoints.tool_parsers.stream_replay import replay, without_ids

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
# An escaped quote before brackets, an escaped backslash before a closing quote, escapes, literals.
TRICKY = '{"name": "search", "arguments": {"q": "say \\"hi } ] in C:\\\\", "e": "\\u00e9t\\u00e9", "n": 1.5e3, "ok": true}}'


def test_no_tool_call_is_all_content():
    result = HermesToolParser().extract_tool_calls("The weather is nice <b>today</b>.")
    assert not result.tools_called and result.tool_calls == []
    assert result.content == "The weather is nice <b>today</b>."


def test_one_call_with_text_before_and_after():
    text = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\nOne moment."
    result = HermesToolParser().extract_tool_calls(text)
    assert result.tools_called
    [call] = result.tool_calls
    assert call["id"].startswith("chatcmpl-tool-") and len(call["id"]) > len("chatcmpl-tool-") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}
    assert result.content == "Let me check.\n\nOne moment."


def test_several_calls_and_only_calls_give_null_content():
    text = (f"<tool_call>{WEATHER}</tool_call>\n<tool_call>{TRICKY}</tool_call>\n"
            '<tool_call>[{"name": "a", "arguments": {}}, {"arguments": {"x": [1, 2]}, "name": "b"}]</tool_call>\n')
    result = HermesToolParser().extract_tool_calls(text)
    assert [c["function"]["name"] for c in result.tool_calls] == ["get_weather", "search", "a", "b"]
    assert len({c["id"] for c in result.tool_calls}) == 4
    assert json.loads(result.tool_calls[1]["function"]["arguments"]) == json.loads(TRICKY)["arguments"]
    assert [c["function"]["arguments"] for c in result.tool_calls[2:]] == ["{}", '{"x":[1,2]}']
    assert result.content is None


def test_call_without_arguments_gets_an_empty_object_and_empty_list_calls_nothing():
    result = HermesToolParser().extract_tool_calls('<tool_call>{"name": "now"}</tool_call>')
    assert result.tool_calls[0]["function"] == {"name": "now", "arguments": "{}"}
    result = HermesToolParser().extract_tool_calls("Nothing to call.<tool_call>[]</tool_call>")
    assert not result.tools_called and result.content == "Nothing to call."


def test_block_left_open_at_the_end_still_counts():  # a stop string or EOS right after the JSON
    result = HermesToolParser().extract_tool_calls(f"<tool_call>{WEATHER}")
    assert [c["function"]["name"] for c in result.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("block", [
    "not json",
    '{"name": "f", "arguments": {"a": 1}',     # the outer object never closes
    '{"name": "f", "arguments": {"a": tru}}',  # an invalid literal
    '{"arguments": {"a": 1}}',                 # no name
    '{"name": 3, "arguments": {}}',
    '{"name": "f", "arguments": "a string"}',
    '{"name": "f", "arguments": {}} trailing',
    '[{"name": "f", "arguments": {}} {"name": "g"}]',
])
def test_malformed_block_is_content(block):
    text = f"Hi <tool_call>{block}</tool_call> bye"
    result = HermesToolParser().extract_tool_calls(text)
    assert not result.tools_called and result.content == text


REPLIES = [
    "Just text, with a < sign and a <tool mention but no call.",
    f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\nOne moment.",
    f"<tool_call>{WEATHER}</tool_call>\n<tool_call>\n{TRICKY}\n</tool_call>\n",
    '<tool_call>[\n{"name": "a", "arguments": {"k": [1, {"z": null}]}},\n{"name": "b", "arguments": {}}\n]</tool_call>',
    '<tool_call>[{"name": "a", "arguments": {"i": 1}}, {"name": "b", "arguments": {"i": 2}}, '
    '{"name": "c", "arguments": {"i": 3}}, {"name": "d"}]</tool_call>',
    '<tool_call>{"arguments": {"late": "name"}, "name": "f"}</tool_call> after',
    "A <tool_call>not json</tool_call> then <tool_call>" + WEATHER + "</tool_call>",
    f"<tool_call>{WEATHER}",
    "Ends in a partial tag <tool_ca",
]


@pytest.mark.parametrize("text", REPLIES)
@pytest.mark.parametrize("seed", range(6))
def test_streaming_reassembles_to_the_non_streaming_result(text, seed):
    expected = HermesToolParser().extract_tool_calls(text)
    deltas, content, tool_calls = replay(HermesToolParser(), text, seed)
    assert without_ids(tool_calls) == without_ids(expected.tool_calls)
    assert content == expected.content
    for call in tool_calls:
        json.loads(call["function"]["arguments"])
    if expected.tools_called and "not json" not in text:
        assert all("tool_call>" not in d.get("content", "") for d in deltas)


def test_streaming_announces_a_call_before_its_arguments_finish():
    parser = HermesToolParser()
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    delta = parser.extract_tool_calls_streaming("", text, text)
    [entry] = delta["tool_calls"]
    assert entry["function"] == {"name": "get_weather", "arguments": '{"city":"Par'}
    assert "content" not in delta
    delta = parser.extract_tool_calls_streaming(text, text + 'is"}}</tool_call>', 'is"}}</tool_call>')
    assert delta == {"tool_calls": [{"index": 0, "function": {"arguments": 'is"}'}}]}
