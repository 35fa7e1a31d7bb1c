"""The tool parser interface (vLLM's shape), its registry by ``--tool-call-parser`` name, and the
choice of a parser from a model's chat template."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ExtractedToolCallInformation:
    """What a finished reply holds: ``tool_calls`` in OpenAI's ``message.tool_calls`` format
    (``{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}``) and the
    ``content`` outside them (None when the reply is only tool calls)."""

    tools_called: bool
    tool_calls: list[dict] = field(default_factory=list)
    content: str | None = None


class ToolParser(ABC):
    """Reads a model's tool calls out of its text. Make one per request: the streaming methods
    keep state between steps.

    Streaming returns OpenAI ``delta`` dicts, or None when a step adds nothing to send:
    ``{"content": str}`` and/or ``{"tool_calls": [{"index", "id", "type": "function",
    "function": {"name", "arguments"}}]}`` for a call's first delta, then ``{"index", "function":
    {"arguments": <fragment>}}``; a call's fragments concatenate to its JSON arguments.
    """

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer

    @abstractmethod
    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCallInformation:
        """The tool calls and content of a finished reply."""

    @abstractmethod
    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int] = (),
                                     current_token_ids: Sequence[int] = (),
                                     delta_token_ids: Sequence[int] = (),
                                     request: Any = None) -> dict | None:
        """The delta for one step: ``current_text`` is the reply so far, ``delta_text`` its new end."""

    @abstractmethod
    def finish_streaming(self, current_text: str, request: Any = None) -> dict | None:
        """The last delta, once the reply has ended: text held back in case it began a tag, and the
        calls of a block the reply left open."""


class ToolParserManager:
    """The registry of tool parsers by their ``--tool-call-parser`` name (vLLM's names)."""

    tool_parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register_module(cls, name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
        def register(parser: type[ToolParser]) -> type[ToolParser]:
            cls.tool_parsers[name] = parser
            return parser
        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name not in cls.tool_parsers:
            raise ValueError(f"tool_call_parser: unknown parser {name!r}; "
                             f"choose one of {', '.join(sorted(cls.tool_parsers))}")
        return cls.tool_parsers[name]


# Markers a chat template writes when it renders tool calls, most specific first.
_TEMPLATE_MARKERS = (("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"), ("<tool_call>", "hermes"))
DEFAULT_TOOL_PARSER = "hermes"


def tool_parser_for_chat_template(chat_template: str | None) -> str:
    """The ``--tool-call-parser`` name for a model, from the tool-call markers of its chat template.

    A template without any (plain ChatML such as SmolLM2-Instruct's, which does not render tools)
    gets ``hermes``: SmolLM2 was trained to answer ``<tool_call>[{"name", "arguments"}, ...]
    </tool_call>``, which the hermes parser reads, and for a model that never writes the tags the
    parser returns the whole reply as content, so the default costs nothing.
    """
    for marker, name in _TEMPLATE_MARKERS:
        if chat_template and marker in chat_template and name in ToolParserManager.tool_parsers:
            return name
    return DEFAULT_TOOL_PARSER
