"""A tool parser for formats that write calls as JSON blocks between tags (hermes, mistral)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .abstract_tool_parser import ExtractedToolCallInformation, ToolParser
from .json_tool_calls import tool_call_dict
from .tool_call_stream import ToolCallStream


def information_from_delta(delta: dict | None) -> ExtractedToolCallInformation:
    """The result of a whole reply from the one delta a fresh stream gives for all of it: the
    non-streaming result is the streaming one in a single step, so the two always agree."""
    delta = delta or {}
    tool_calls = [tool_call_dict(call["function"]["name"], call["function"]["arguments"], call["id"])
                  for call in delta.get("tool_calls", [])]
    return ExtractedToolCallInformation(tools_called=bool(tool_calls), tool_calls=tool_calls,
                                        content=delta.get("content"))


class JsonBlockToolParser(ToolParser):
    """Calls are ``start_tag`` + one call object or a list of them + ``end_tag`` (None: to the
    end of the reply). Text outside the blocks is content, and so is a block that is not JSON of
    that shape."""

    start_tag: str
    end_tag: str | None

    def __init__(self, tokenizer: Any = None):
        super().__init__(tokenizer)
        self._stream = ToolCallStream(self.start_tag, self.end_tag)

    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCallInformation:
        return information_from_delta(ToolCallStream(self.start_tag, self.end_tag).advance(model_output, final=True))

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int] = (),
                                     current_token_ids: Sequence[int] = (),
                                     delta_token_ids: Sequence[int] = (),
                                     request: Any = None) -> dict | None:
        return self._stream.advance(current_text, final=False)

    def finish_streaming(self, current_text: str, request: Any = None) -> dict | None:
        return self._stream.advance(current_text, final=True)
