"""The tool parser interface (vLLM's shape), its registry by ``--tool-call-parser`` name, and the
choice of a parser from a model's chat template."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .json_tool_calls import tool_call_dict


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

    A parser implements one method, ``advance``; the streaming and the whole-reply methods are
    both built on it, so the two always agree: a whole reply is the stream of a fresh parser
    read in a single final step.
    """

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer

    @abstractmethod
    def advance(self, current_text: str, final: bool) -> dict | None:
        """The delta that ``current_text`` (the reply so far; ``final``: all of it) adds to what
        earlier calls returned."""

    def fresh(self) -> ToolParser:
        """A parser of the same kind and configuration with no stream state."""
        return type(self)(self.tokenizer)

    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCallInformation:
        """The tool calls and content of a finished reply."""
        return information_from_delta(self.fresh().advance(model_output, final=True))

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int] = (),
                                     current_token_ids: Sequence[int] = (),
                                     delta_token_ids: Sequence[int] = (),
                                     request: Any = None) -> dict | None:
        """The delta for one step (vLLM's signature): ``current_text`` is the reply so far,
        ``delta_text`` its new end."""
        return self.advance(current_text, final=False)

    def finish_streaming(self, current_text: str, request: Any = None) -> dict | None:
        """The last delta, once the reply has ended: text held back in case it began a tag, and the
        calls of a block the reply left open."""
        return self.advance(current_text, final=True)


def information_from_delta(delta: dict | None) -> ExtractedToolCallInformation:
    """The result of a whole reply from the one delta a fresh stream gives for all of it."""
    delta = delta or {}
    tool_calls = [tool_call_dict(call["function"]["name"], call["function"]["arguments"], call["id"])
                  for call in delta.get("tool_calls", [])]
    return ExtractedToolCallInformation(tools_called=bool(tool_calls), tool_calls=tool_calls,
                                        content=delta.get("content"))


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
