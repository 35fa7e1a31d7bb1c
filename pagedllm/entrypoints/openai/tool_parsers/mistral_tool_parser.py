"""Mistral tool calls (tokenizers before v11): ``[TOOL_CALLS]`` and then a JSON list of
``{"name", "arguments"}`` objects to the end of the reply; text before the marker is content.
``[TOOL_CALLS]`` is a special token: detokenize with ``skip_special_tokens=False``."""

from __future__ import annotations

from .abstract_tool_parser import ToolParserManager
from .json_block_tool_parser import JsonBlockToolParser


@ToolParserManager.register_module("mistral")
class MistralToolParser(JsonBlockToolParser):
    start_tag = "[TOOL_CALLS]"
    end_tag = None
