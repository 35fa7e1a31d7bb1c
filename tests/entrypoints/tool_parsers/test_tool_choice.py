"""tool_choice 'required' / named: validation, the forcing JSON schema (checked with jsonschema and
compiled by xgrammar), and the reading of the forced output back into tool calls."""

import json

import jsonschema
import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from pagedllm.entrypoints.openai.tool_parsers import (
    ConstrainedToolParser,
    tool_choice_json_schema,
    validate_tool_choice,
    validate_tools,
)
from tests.entrypoints.tool_parsers.stream_replay import replay, without_ids

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
MOVE = {"type": "function", "function": {
    "name": "move", "parameters": {"type": "object", "properties": {"to": {"$ref": "#/$defs/point"}},
                                   "required": ["to"], "$defs": {"point": {
                                       "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                       "required": ["x", "y"], "additionalProperties": False}}}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters
TOOLS = [WEATHER, MOVE, NOW]


def accepts(schema: dict, value) -> bool:
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def grammar_accepts(schema: dict, text: str) -> bool:
    return _is_grammar_accept_string(xgrammar.Grammar.from_json_schema(json.dumps(schema)), text)


def test_named_choice_schema_is_the_functions_parameters():
    schema = tool_choice_json_schema(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert schema == WEATHER["function"]["parameters"]
    assert accepts(schema, {"city": "Paris", "unit": "celsius"})
    assert not accepts(schema, {"city": "Paris", "unit": "kelvin"})
    assert not accepts(schema, {"city": "Paris"})
    assert grammar_accepts(schema, '{"city": "Paris", "unit": "celsius"}')
    assert not grammar_accepts(schema, '{"city": "Paris", "unit": "kelvin"}')
    empty = tool_choice_json_schema(TOOLS, {"type": "function", "function": {"name": "now"}})
    assert empty == {"type": "object", "properties": {}} and grammar_accepts(empty, "{}")


GOOD_REQUIRED = [
    [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}],
    [{"name": "move", "parameters": {"to": {"x": 1, "y": 2}}}, {"name": "now", "parameters": {}}],
]
BAD_REQUIRED = [
    [],                                                                   # at least one call
    [{"name": "get_weather", "parameters": {"to": {"x": 1, "y": 2}}}],    # another tool's arguments
    [{"name": "move", "parameters": {"to": {"x": "one", "y": 2}}}],       # $defs reached through $ref
    [{"name": "fly", "parameters": {}}],                                  # not a tool
    [{"name": "now"}],                                                    # parameters are required
]


def test_required_schema_forces_a_list_of_calls_valid_against_their_own_tool():
    schema = tool_choice_json_schema(TOOLS, "required")
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$defs"] == MOVE["function"]["parameters"]["$defs"]
    assert "$defs" in MOVE["function"]["parameters"], "the request's tools are not modified"
    for value in GOOD_REQUIRED:
        assert accepts(schema, value), value
        assert grammar_accepts(schema, json.dumps(value)), value
    for value in BAD_REQUIRED:
        assert not accepts(schema, value), value
        assert not grammar_accepts(schema, json.dumps(value)), value


def test_parallel_tool_calls_false_allows_exactly_one_call():
    schema = tool_choice_json_schema(TOOLS, "required", parallel_tool_calls=False)
    assert accepts(schema, GOOD_REQUIRED[0]) and not accepts(schema, GOOD_REQUIRED[1])
    assert not grammar_accepts(schema, json.dumps(GOOD_REQUIRED[1]))
    assert "maxItems" not in tool_choice_json_schema(TOOLS, "required")


@pytest.mark.parametrize("choice", [None, "none", "auto"])
def test_unforced_choices_have_no_schema(choice):
    assert tool_choice_json_schema(TOOLS, choice) is None


@pytest.mark.parametrize("tools,message", [
    ({"type": "function"}, r"^tools must be a list"),
    ([WEATHER, "move"], r"^tools\[1\] must be an object"),
    ([{"type": "retrieval", "function": {"name": "f"}}], r"^tools\[0\]\.type must be 'function'"),
    ([WEATHER, {"type": "function"}], r"^tools\[1\]\.function must be an object"),
    ([WEATHER, {"type": "function", "function": {"name": ""}}], r"^tools\[1\]\.function\.name must be"),
    ([WEATHER, {"type": "function", "function": {"description": "x"}}], r"^tools\[1\]\.function\.name must be"),
    ([NOW, NOW], r"^tools\[1\]\.function\.name 'now' is used by an earlier tool"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
     r"^tools\[0\]\.function\.parameters must be a JSON schema of an object"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
     r"^tools\[0\]\.function\.parameters must be"),
])
def test_bad_tools_are_refused_naming_the_field(tools, message):
    with pytest.raises(ValueError, match=message):
        validate_tools(tools)
    with pytest.raises(ValueError, match=message):
        tool_choice_json_schema(tools, "required")


@pytest.mark.parametrize("choice,tools,message", [
    ("required", [], r"^tool_choice 'required' needs a non-empty tools list"),
    ("any", TOOLS, r"^tool_choice must be one of none, auto, required"),
    ({"type": "function", "function": {"name": "fly"}}, TOOLS,
     r"^tool_choice\.function\.name 'fly' is not one of the tools \(get_weather, move, now\)"),
    ({"type": "function", "function": {"name": "now"}}, [], r"^tool_choice\.function\.name 'now' is not one"),
    ({"type": "function", "name": "now"}, TOOLS, r"^tool_choice must be a mode or"),
    (["required"], TOOLS, r"^tool_choice must be a mode or"),
])
def test_bad_tool_choice_is_refused_naming_the_field(choice, tools, message):
    with pytest.raises(ValueError, match=message):
        validate_tool_choice(choice, tools)


def test_conflicting_definitions_are_refused_naming_the_tool():
    other = json.loads(json.dumps(MOVE))
    other["function"]["name"] = "jump"
    other["function"]["parameters"]["$defs"]["point"]["required"] = ["x"]
    with pytest.raises(ValueError, match=r"^tools\[1\]\.function\.parameters\.\$defs\.point differs"):
        tool_choice_json_schema([MOVE, other], "required")


def test_required_output_becomes_tool_calls_whole_and_streamed():
    text = json.dumps(GOOD_REQUIRED[1], indent=2)
    result = ConstrainedToolParser(TOOLS, "required").extract_tool_calls(text)
    assert result.tools_called and result.content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.tool_calls] == \
        [(c["name"], c["parameters"]) for c in GOOD_REQUIRED[1]]
    for seed in range(4):
        _, content, tool_calls = replay(ConstrainedToolParser(TOOLS, "required"), text, seed)
        assert content is None and without_ids(tool_calls) == without_ids(result.tool_calls)


def test_named_output_becomes_one_call_whole_and_streamed():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    text = '{ "city": "Paris",\n  "unit": "celsius" }'
    result = ConstrainedToolParser(TOOLS, choice).extract_tool_calls(text)
    assert without_ids(result.tool_calls) == [{"type": "function", "function": {
        "name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}}]
    assert result.content is None
    for seed in range(4):
        deltas, content, tool_calls = replay(ConstrainedToolParser(TOOLS, choice), text, seed)
        assert content is None and without_ids(tool_calls) == without_ids(result.tool_calls)
        assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_cut_off_required_output_is_content_not_an_error():
    text = '[{"name": "get_weather", "parameters": {"city": "Par'  # max_tokens reached
    result = ConstrainedToolParser(TOOLS, "required").extract_tool_calls(text)
    assert not result.tools_called and result.content == text


@pytest.mark.parametrize("choice", ["auto", "none", None])
def test_constrained_parser_refuses_unforced_choices(choice):
    with pytest.raises(ValueError, match=r"^tool_choice .* is not enforced by a grammar"):
        ConstrainedToolParser(TOOLS, choice)
