"""Pythonic tool calls (Llama 3.2 / 4, ToolACE): the reply is a Python list of calls with literal
arguments, ``[get_weather(city="Paris", days=2), get_time()]``, optionally between Llama 4's
``<|python_start|>`` and ``<|python_end|>``. Any other reply is content.

Streaming sends the calls whole, in the step where the list closes (or at the end of the reply):
arguments written as Python literals cannot be sent as JSON fragments before they are complete.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from .abstract_tool_parser import ToolParser, ToolParserManager
from .json_tool_calls import tool_call_dict

START, END = "<|python_start|>", "<|python_end|>"


def _strip_markers(text: str) -> str:
    text = text.strip()
    if text.startswith(START):
        text = text[len(START):].removesuffix(END).strip()
    return text


def parse_pythonic_calls(text: str) -> list[dict] | None:
    """The tool calls of a reply that is a Python list of calls with literal arguments; else None."""
    try:
        tree = ast.parse(_strip_markers(text), mode="eval").body
        if not isinstance(tree, ast.List) or not all(isinstance(call, ast.Call) for call in tree.elts):
            return None
        calls = []
        for call in tree.elts:
            if not isinstance(call.func, ast.Name) or call.args or any(kw.arg is None for kw in call.keywords):
                return None  # positional or **kwargs arguments cannot be named
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
            calls.append(tool_call_dict(call.func.id, json.dumps(arguments, ensure_ascii=False,
                                                                 separators=(",", ":"))))
    except (SyntaxError, ValueError, TypeError):  # not Python, not a literal, not JSON-serialisable
        return None
    return calls


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(ToolParser):
    def __init__(self, tokenizer: Any = None):
        super().__init__(tokenizer)
        self._sent = 0  # characters of the reply settled (sent as content, or read as calls)
        self._is_content: bool | None = None  # None while the reply may still be a call list

    def advance(self, text: str, final: bool) -> dict | None:
        if self._is_content is None:
            head = text.lstrip()
            if head and not (head.startswith("[") or START.startswith(head[:len(START)])):
                self._is_content = True
            else:
                calls = parse_pythonic_calls(text)
                if calls is None and not final:
                    return None
                self._is_content = calls is None
                if calls is not None:
                    self._sent = len(text)
                    return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]} if calls else None
        fragment, self._sent = text[self._sent:], len(text)
        return {"content": fragment} if fragment and self._is_content else None
