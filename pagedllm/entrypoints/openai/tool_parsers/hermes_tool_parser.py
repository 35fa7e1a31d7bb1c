"""Hermes-style tool calls (Hermes 2 Pro, Qwen 2.5+, SmolLM2/3): ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>``, one block per call, several per reply. A block holding a list of
call objects (SmolLM2's ``<tool_call>[{...}, {...}]</tool_call>``) is read as those calls.

Where the tags are special tokens (Hermes 2 Pro, Qwen), the reply must be detokenized with
``skip_special_tokens=False`` for the parser to see them."""

from __future__ import annotations

from .abstract_tool_parser import ToolParserManager
from .json_block_tool_parser import JsonBlockToolParser


@ToolParserManager.register_module("hermes")
class HermesToolParser(JsonBlockToolParser):
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
