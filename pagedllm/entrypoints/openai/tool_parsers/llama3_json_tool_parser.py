"""Llama 3.1 / 3.2 JSON tool calls: a reply that starts (after an optional ``<|python_tag|>``) with
``{"name": ..., "parameters": {...}}``, several separated by ``;``. Any other reply is content, as
in vLLM's ``llama3_json`` parser: Llama writes calls only at the start of a reply. (A reply
detokenized with special tokens skipped has no tag and starts with ``{`` directly.)"""

from __future__ import annotations

from typing import Any

from .abstract_tool_parser import ToolParser, ToolParserManager
from .tool_call_stream import ToolCallStream

PYTHON_TAG = "<|python_tag|>"


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """Until the reply's first characters show whether it is a call, nothing is sent. Then either
    all of it streams as content, or the text after the tag is one block of calls."""

    def __init__(self, tokenizer: Any = None):
        super().__init__(tokenizer)
        self._calls: ToolCallStream | None = None
        self._calls_offset = 0  # where the calls begin in the reply (past the tag)
        self._plain_text_sent: int | None = None  # set once the reply is known to be content

    def advance(self, text: str, final: bool) -> dict | None:
        if self._calls is None and self._plain_text_sent is None:
            head = text.lstrip()
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self._calls = ToolCallStream(None, None, separator=";")
                self._calls_offset = text.index(PYTHON_TAG) + len(PYTHON_TAG) if head.startswith(PYTHON_TAG) else 0
            elif PYTHON_TAG.startswith(head) and not final:  # too early to tell
                return None
            else:
                self._plain_text_sent = 0
        if self._calls is not None:
            return self._calls.advance(text[self._calls_offset:], final)
        fragment, self._plain_text_sent = text[self._plain_text_sent:], len(text)
        return {"content": fragment} if fragment else None
