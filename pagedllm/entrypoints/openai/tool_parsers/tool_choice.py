"""The request side of tool calling: validation of ``tools`` / ``tool_choice``, the JSON schema that
forces a ``required`` or named choice (for the structured-output grammar), and the reading of the
output that schema produced back into OpenAI tool calls.

The schemas are vLLM's: a named function's reply is its arguments object itself (schema: the
function's ``parameters``); a ``required`` reply is a JSON list of 1..N calls (exactly one when
``parallel_tool_calls`` is false), each ``{"name": <that tool's name>, "parameters": <its
schema>}``, one ``anyOf`` branch per tool so that the arguments are checked against the schema of
the function named. The tools' ``$defs`` are moved to the root, where their ``#/$defs/...``
references point.
"""

from __future__ import annotations

import copy
from typing import Any

from .abstract_tool_parser import ToolParser
from .json_tool_calls import compact_json, make_tool_call_id
from .tool_call_stream import ToolCallStream

TOOL_CHOICE_MODES = ("none", "auto", "required")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_DEFINITION_KEYS = ("$defs", "definitions")


def validate_tools(tools: Any) -> list[dict]:
    """Check OpenAI function tools; return them (``[]`` for None). Errors name the field."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of function tools, got {type(tools).__name__}")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where} must be an object, got {type(tool).__name__}")
        if tool.get("type") != "function":
            raise ValueError(f"{where}.type must be 'function', got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function must be an object with a 'name'")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name must be a non-empty string, got {name!r}")
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is used by an earlier tool")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None and (not isinstance(parameters, dict)
                                       or parameters.get("type", "object") != "object"):
            raise ValueError(f"{where}.function.parameters must be a JSON schema of an object "
                             "(the arguments are a JSON object)")
    return tools


def validate_tool_choice(tool_choice: Any, tools: list[dict]) -> str | None:
    """Check ``tool_choice`` against validated ``tools``; return the function name of a named
    choice, None for a mode. Errors name the field."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if tool_choice == "required":
        if not tools:
            raise ValueError("tool_choice 'required' needs a non-empty tools list")
        return None
    if isinstance(tool_choice, str):
        raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICE_MODES)} or "
                         f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}")
    named = isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
    if not named or not isinstance(tool_choice.get("function"), dict):
        raise ValueError("tool_choice must be a mode or {'type': 'function', 'function': {'name': ...}}")
    name = tool_choice["function"].get("name")
    names = [tool["function"]["name"] for tool in tools]
    if name not in names:
        raise ValueError(f"tool_choice.function.name {name!r} is not one of the tools "
                         f"({', '.join(names) or 'none given'})")
    return name


def _parameters(tool: dict) -> dict:
    return copy.deepcopy(tool["function"].get("parameters") or _EMPTY_PARAMETERS)


def _hoist_definitions(schemas: list[dict]) -> dict:
    """Move each schema's ``$defs`` / ``definitions`` out (in place) into one root-level dict."""
    hoisted: dict[str, dict] = {}
    for i, schema in enumerate(schemas):
        for key in _DEFINITION_KEYS:
            for def_name, definition in schema.pop(key, {}).items():
                if hoisted.setdefault(key, {}).setdefault(def_name, definition) != definition:
                    raise ValueError(f"tools[{i}].function.parameters.{key}.{def_name} differs from "
                                     "an earlier tool's definition of the same name")
    return hoisted


def tool_choice_json_schema(tools: Any, tool_choice: Any, parallel_tool_calls: bool = True) -> dict | None:
    """The JSON schema that forces the reply of a ``required`` or named ``tool_choice``; None for
    ``none`` / ``auto`` (nothing to force)."""
    tools = validate_tools(tools)
    name = validate_tool_choice(tool_choice, tools)
    if name is not None:
        return _parameters(next(tool for tool in tools if tool["function"]["name"] == name))
    if tool_choice != "required":
        return None
    parameters = [_parameters(tool) for tool in tools]
    definitions = _hoist_definitions(parameters)
    branches = [{"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                "parameters": schema},
                 "required": ["name", "parameters"]}
                for tool, schema in zip(tools, parameters)]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return {**schema, **definitions}


class ConstrainedToolParser(ToolParser):
    """Reads the output that ``tool_choice_json_schema`` forced back into tool calls, whole or
    streaming. Make one per request. Never raises on a cut-off output (``max_tokens``): a named
    call then carries the arguments as written, a ``required`` list that did not close is content.
    """

    def __init__(self, tools: Any, tool_choice: Any, tokenizer: Any = None):
        super().__init__(tokenizer)
        self.tools, self.tool_choice = tools, tool_choice
        self.function_name = validate_tool_choice(tool_choice, validate_tools(tools))
        if self.function_name is None and tool_choice != "required":
            raise ValueError(f"tool_choice {tool_choice!r} is not enforced by a grammar")
        self._stream = ToolCallStream(None, None)  # required: the whole reply is one list
        self._named_call_id: str | None = None
        self._named_arguments_sent = 0

    def fresh(self) -> ConstrainedToolParser:
        return ConstrainedToolParser(self.tools, self.tool_choice, self.tokenizer)

    def advance(self, current_text: str, final: bool) -> dict | None:
        if self.function_name is None:
            return self._stream.advance(current_text, final)
        arguments = compact_json(current_text)
        if self._named_call_id is None:
            self._named_call_id = make_tool_call_id()
            self._named_arguments_sent = len(arguments)
            return {"tool_calls": [{"index": 0, "id": self._named_call_id, "type": "function",
                                    "function": {"name": self.function_name, "arguments": arguments}}]}
        fragment, self._named_arguments_sent = arguments[self._named_arguments_sent:], len(arguments)
        return {"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]} if fragment else None
