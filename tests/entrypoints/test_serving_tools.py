"""The serving layer of tool calling and output constraints without an engine: scripted model
text through the auto parser (whole and streamed), parallel_tool_calls, the tool_choice rules,
and the mapping of every constraint field to one StructuredOutputsParams with errors named."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_tools import (
    ChoiceToolStream,
    ToolConfig,
    finish_reason,
    plan_tools,
    whole_reply,
)
from pagedllm.entrypoints.openai.structured_outputs import (
    Constraint,
    rename_constraint_error,
    request_constraint,
)
from pagedllm.sampling_params import StructuredOutputsParams

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}]
TWO_CALLS = ('Let me. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
             '<tool_call>{"name": "f", "arguments": {"x": 2}}</tool_call>')


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def _streamed(plan, text: str, piece: int = 3) -> tuple[str | None, list[dict], bool]:
    stream = ChoiceToolStream(plan, None)
    content, calls = None, {}
    for i in range(0, len(text), piece):
        delta = stream.step(text[i:i + piece], finished=i + piece >= len(text))
        if "content" in delta:
            content = (content or "") + delta["content"]
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"name": call["function"].get("name"), "arguments": ""})
            entry["arguments"] += call["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)], stream.called_tools


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_reads_calls_whole_and_streamed_alike(parallel):
    plan = plan_tools(_request(tools=TOOLS, parallel_tool_calls=parallel), ToolConfig(), None)
    assert plan.parser_name == "hermes" and plan.schema is None
    content, calls = whole_reply(plan, None, TWO_CALLS)
    expected = [{"name": "f", "arguments": '{"x":1}'}, {"name": "f", "arguments": '{"x":2}'}][:2 if parallel else 1]
    assert content == "Let me. " and [c["function"] for c in calls] == expected
    assert _streamed(plan, TWO_CALLS) == ("Let me. ", expected, True)


def test_auto_plain_text_is_content_and_finish_reason_stays():
    plan = plan_tools(_request(tools=TOOLS), ToolConfig(), None)
    assert whole_reply(plan, None, "Hello <tool") == ("Hello <tool", [])
    assert _streamed(plan, "Hello <tool") == ("Hello <tool", [], False)
    assert finish_reason("stop", False) == "stop" and finish_reason("stop", True) == "tool_calls"
    assert finish_reason("length", True) == "length"


def test_parser_from_the_flag_or_the_template():
    assert plan_tools(_request(tools=TOOLS), ToolConfig("mistral"), None).parser_name == "mistral"
    assert plan_tools(_request(tools=TOOLS), ToolConfig(), "{{ '[TOOL_CALLS]' }}").parser_name == "mistral"
    with pytest.raises(ValueError, match="^tool_call_parser: unknown parser"):
        ToolConfig("nope")
    with pytest.raises(ValueError, match="^tool_choice: 'auto' needs"):
        plan_tools(_request(tools=TOOLS), ToolConfig(enable_auto_tool_choice=False), None)


def test_forced_choices_carry_a_schema_and_none_parses_nothing():
    required = plan_tools(_request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), ToolConfig(), None)
    assert required.schema["maxItems"] == 1 and required.parses_calls
    named = plan_tools(_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}}),
                       ToolConfig(), None)
    assert named.schema == TOOLS[0]["function"]["parameters"]
    assert whole_reply(named, None, '{"x": 3}')[1][0]["function"] == {"name": "f", "arguments": '{"x":3}'}
    none = plan_tools(_request(tools=TOOLS, tool_choice="none"), ToolConfig(), None)
    assert not none.parses_calls and none.tools == TOOLS and whole_reply(none, None, TWO_CALLS) == (TWO_CALLS, [])
    with pytest.raises(ValueError, match="^tool_choice: only allowed when tools are given"):
        plan_tools(_request(tool_choice="auto"), ToolConfig(), None)


# -- constraints -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,expected", [
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"},
                                                                "strict": False}}},
     StructuredOutputsParams(json={"type": "object"})),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"choice": ["a"], "disable_fallback": True}}, StructuredOutputsParams(choice=["a"])),
    ({"guided_json": '{"type": "object"}'}, StructuredOutputsParams(json='{"type": "object"}')),
    ({"guided_regex": "a+", "guided_decoding_backend": "auto"}, StructuredOutputsParams(regex="a+")),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
])
def test_each_field_becomes_one_constraint(fields, expected):
    constraint = request_constraint(fields)
    assert (constraint.params if constraint else None) == expected


@pytest.mark.parametrize("fields,message", [
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "^guided_regex: cannot be combined"),
    ({"structured_outputs": {"regex": ""}}, r"^structured_outputs\.regex must be a non-empty string"),
    ({"structured_outputs": {"backend": "x"}}, r"^structured_outputs\.backend: not supported"),
    ({"guided_choice": "yes"}, "^guided_choice: choice must be a non-empty list"),
    ({"guided_decoding_backend": "outlines"}, "^guided_decoding_backend: only xgrammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
     r"^response_format\.json_schema\.schema must be"),
])
def test_bad_constraint_fields_are_named(fields, message):
    with pytest.raises((ValueError, TypeError), match=message):
        request_constraint(fields)


def test_a_forced_tool_choice_conflicts_with_any_other_constraint_by_its_name():
    with pytest.raises(ValueError, match="^guided_json: cannot be combined with tool_choice"):
        request_constraint({"guided_json": {"type": "object"}}, tool_schema={"type": "object"})


def test_engine_errors_are_restated_with_the_requests_field():
    constraint = Constraint(StructuredOutputsParams(regex="("), "guided_regex")
    renamed = rename_constraint_error(ValueError("regex is not a valid regular expression: x"), constraint)
    assert str(renamed) == "guided_regex: regex is not a valid regular expression: x"
    other = ValueError("prompt is too long")
    assert rename_constraint_error(other, constraint) is other
    tools = Constraint(StructuredOutputsParams(json={"type": "object"}), "tool_choice")
    assert str(rename_constraint_error(ValueError("json is not a valid JSON schema"), tools)).startswith("tools: ")
