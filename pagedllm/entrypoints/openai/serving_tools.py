"""Tool calling in ``/v1/chat/completions``: what a request's ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` ask for (``ToolPlan``), and turning each choice's text into OpenAI's
``message.tool_calls`` (whole) or ``delta.tool_calls`` chunks (streaming, ``ChoiceToolStream``).

- ``tool_choice`` ``none``: the tools reach the template, the reply is content.
- ``auto`` (the default when tools are given, as OpenAI's): the model writes calls in its own
  format; the parser is ``--tool-call-parser`` or the one picked from the chat template.
- ``required`` or a named function: a grammar built from the tools' ``parameters`` forces the
  reply (``tool_choice_json_schema``), and ``ConstrainedToolParser`` reads it back.

A choice whose reply called tools ends with ``finish_reason`` ``"tool_calls"`` (unless it was cut
by ``max_tokens``: then ``"length"``, and its arguments may be incomplete).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tool_parsers import (
    ConstrainedToolParser,
    ToolParser,
    ToolParserManager,
    tool_choice_json_schema,
    tool_parser_for_chat_template,
    validate_tools,
)


@dataclass(frozen=True)
class ToolConfig:
    """The server's tool-calling flags (vLLM's names). ``tool_call_parser``: a registered parser
    name, or None to pick one from each request's chat template. ``enable_auto_tool_choice``:
    False refuses ``tool_choice`` ``auto`` (vLLM's default; here auto is on by default)."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = True

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            ToolParserManager.get_tool_parser(self.tool_call_parser)  # ValueError naming it when unknown


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request does with tools. ``tools``: validated (``[]`` without any);
    ``schema``: the JSON schema a forced choice imposes (None for none / auto); ``parser_name``:
    the auto parser (None: the text is plain content); ``parallel``: more than one call allowed."""

    tools: list[dict] = field(default_factory=list)
    tool_choice: Any = None
    schema: dict | None = None
    parser_name: str | None = None
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        return self.schema is not None or self.parser_name is not None

    def new_parser(self, tokenizer: Any) -> ToolParser | None:
        """A fresh parser for one choice; None when the text is plain content."""
        if self.schema is not None:
            return ConstrainedToolParser(self.tools, self.tool_choice, tokenizer)
        if self.parser_name is not None:
            return ToolParserManager.get_tool_parser(self.parser_name)(tokenizer)
        return None


def plan_tools(req: ChatCompletionRequest, config: ToolConfig, chat_template: str | None) -> ToolPlan:
    """The request's ``ToolPlan``; ValueError naming ``tools`` / ``tool_choice`` on a bad value.
    ``chat_template``: the template source the request renders with (it picks the auto parser)."""
    tools = validate_tools(req.tools)
    parallel = req.parallel_tool_calls is not False
    choice = req.tool_choice
    if not tools:
        if choice is not None and choice != "none":
            raise ValueError("tool_choice: only allowed when tools are given")
        return ToolPlan(parallel=parallel)
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are present
    schema = tool_choice_json_schema(tools, choice, parallel)
    if schema is not None or choice == "none":
        return ToolPlan(tools, choice, schema, None, parallel)
    if not config.enable_auto_tool_choice:
        raise ValueError("tool_choice: 'auto' needs the server to run with --enable-auto-tool-choice")
    parser = config.tool_call_parser or tool_parser_for_chat_template(chat_template)
    return ToolPlan(tools, choice, None, parser, parallel)


def finish_reason(reason: str | None, called_tools: bool) -> str | None:
    """OpenAI's: ``tool_calls`` when a reply that ended by itself called tools."""
    return "tool_calls" if called_tools and reason == "stop" else reason


def whole_reply(plan: ToolPlan, tokenizer: Any, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished reply; content None when only tools were called."""
    parser = plan.new_parser(tokenizer)
    if parser is None:
        return text, []
    info = parser.extract_tool_calls(text)
    calls = info.tool_calls if plan.parallel else info.tool_calls[:1]
    return info.content, calls


class ChoiceToolStream:
    """One streamed choice read through a tool parser: the reply so far in, OpenAI deltas out.

    Invariant: ``text`` is every piece given so far; a call past the first is dropped (all its
    deltas) when ``parallel_tool_calls`` is false. Cost: that of the parser per step."""

    def __init__(self, plan: ToolPlan, tokenizer: Any) -> None:
        self.parser = plan.new_parser(tokenizer)
        self.parallel = plan.parallel
        self.text = ""
        self.called_tools = False

    def step(self, piece: str, finished: bool) -> dict:
        """The delta for a new piece of text (and, once ``finished``, whatever the parser held)."""
        previous, self.text = self.text, self.text + piece
        if self.parser is None:
            return {"content": piece} if piece else {}
        deltas = [self.parser.extract_tool_calls_streaming(previous, self.text, piece)]
        if finished:
            deltas.append(self.parser.finish_streaming(self.text))
        content = "".join(d["content"] for d in deltas if d and d.get("content"))
        calls = [c for d in deltas if d for c in d.get("tool_calls", []) if self.parallel or c["index"] == 0]
        self.called_tools = self.called_tools or bool(calls)
        delta: dict = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta
