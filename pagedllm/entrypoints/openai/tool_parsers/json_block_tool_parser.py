"""A tool parser for formats that write calls as JSON blocks between tags (hermes, mistral)."""

from __future__ import annotations

from typing import Any

from .abstract_tool_parser import ToolParser
from .tool_call_stream import ToolCallStream


class JsonBlockToolParser(ToolParser):
    """Calls are ``start_tag`` + one call object or a list of them + ``end_tag`` (None: to the
    end of the reply). Text outside the blocks is content, and so is a block that is not JSON of
    that shape."""

    start_tag: str
    end_tag: str | None

    def __init__(self, tokenizer: Any = None):
        super().__init__(tokenizer)
        self._stream = ToolCallStream(self.start_tag, self.end_tag)

    def advance(self, current_text: str, final: bool) -> dict | None:
        return self._stream.advance(current_text, final)
