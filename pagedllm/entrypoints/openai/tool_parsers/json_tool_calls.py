"""Tool calls written as JSON in a model's text, read whole or while they stream.

Every JSON-based format (hermes ``<tool_call>{...}</tool_call>``, mistral ``[TOOL_CALLS][...]``, the
``required`` tool choice's ``[{"name", "parameters"}, ...]``, llama3_json's ``{...}; {...}``) is one
*block* of text holding one call object ``{"name": str, "arguments": {...}}``, a list of them, or
several separated by a separator; ``"parameters"`` is read as a synonym of ``"arguments"``. ``parse_calls`` reads a block or any prefix of one, so the same code
serves the finished reply and each streamed step.

The ``arguments`` string handed to the client is the model's own JSON with the whitespace outside
strings dropped (``compact_json``): that is what OpenAI sends (``{"city":"Paris"}``), it is valid
JSON whenever the model's was, and it is stable under streaming: the compaction of a prefix is a
prefix of the compaction of the whole, so argument fragments can be sent as soon as they arrive and
concatenate to exactly the string the non-streaming path returns.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

_WHITESPACE = " \t\n\r"
ARGUMENT_KEYS = ("arguments", "parameters")


def make_tool_call_id() -> str:
    """A fresh tool call id as vLLM makes them: ``chatcmpl-tool-`` and 32 random hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call_dict(name: str, arguments: str, call_id: str | None = None) -> dict:
    """One entry of ``message.tool_calls`` in OpenAI's wire format."""
    return {"id": call_id or make_tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _string_step(char: str, escaped: bool) -> tuple[bool, bool]:
    """One character inside a JSON string: returns (still in the string, next one is escaped)."""
    if escaped:
        return True, False
    return char != '"', char == "\\"


def compact_json(text: str) -> str:
    """``text`` (JSON or a prefix of it) without the whitespace outside strings. Cost: O(len)."""
    out = []
    in_string = escaped = False
    for char in text:
        if in_string:
            in_string, escaped = _string_step(char, escaped)
        elif char in _WHITESPACE:
            continue
        else:
            in_string = char == '"'
        out.append(char)
    return "".join(out)


def json_value_end(text: str, start: int) -> int | None:
    """Index just past the JSON value that begins at ``text[start]``; None if the text ends first.

    Only strings and bracket depth are tracked: this finds where a value ends, ``json.loads``
    judges whether it is valid.
    """
    if text[start] not in '"[{':  # a number, true, false or null ends at a delimiter
        end = start
        while end < len(text) and text[end] not in ",]}" + _WHITESPACE:
            end += 1
        return end if end < len(text) else None
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        char = text[i]
        if in_string:
            in_string, escaped = _string_step(char, escaped)
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        if depth == 0 and not in_string:
            return i + 1
    return None


@dataclass
class PartialToolCall:
    """A call as far as the text shows it. ``name`` is set only once its string is complete;
    ``arguments`` is the compact JSON of the arguments seen so far ("{}" when the closed object had
    none); ``complete`` once the call's object has closed."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


class _TextEnded(Exception):
    """The block is a valid prefix so far; more text is needed."""


class _Malformed(Exception):
    """The text cannot be (a prefix of) one call object or a list of them."""


@dataclass(frozen=True)
class ResumePoint:
    """Where a later parse of the same growing block may start: the call object number
    ``call_index`` begins at ``position``, all the calls before it are complete."""

    position: int
    in_list: bool
    call_index: int


@dataclass
class ParsedBlock:
    """The calls of a block from number ``first_call`` on; ``well_formed`` is False once the text
    cannot be a prefix of the expected shape; ``finished`` once the outer object or list has
    closed; ``resume`` the last point a later parse may start from (None: the beginning)."""

    calls: list[PartialToolCall] = field(default_factory=list)
    first_call: int = 0
    well_formed: bool = True
    finished: bool = False
    resume: ResumePoint | None = None


def parse_calls(block: str, separator: str | None = None, resume: ResumePoint | None = None) -> ParsedBlock:
    """Read the calls in ``block`` (a whole block or a prefix of one): one call object, a JSON list
    of them, or (with ``separator``, e.g. ``";"``) objects separated by it. Each call object must
    be valid JSON. With ``resume`` (from an earlier parse of a prefix of ``block``) the complete
    calls before it are skipped. Cost: O(len(block) - resume.position)."""
    parsed = ParsedBlock(first_call=resume.call_index if resume else 0, resume=resume)
    try:
        _parse_block(block, parsed, separator)
        parsed.finished = True
    except _TextEnded:
        pass
    except (_Malformed, ValueError):  # ValueError: json.loads of a key or a name
        parsed.well_formed = False
    return parsed


def _next(text: str, i: int) -> int:
    """Index of the next non-whitespace character at or after ``i``."""
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    if i == len(text):
        raise _TextEnded
    return i


def _parse_block(block: str, parsed: ParsedBlock, separator: str | None) -> None:
    if parsed.resume is not None:
        i, in_list = parsed.resume.position, parsed.resume.in_list
    else:
        i = _next(block, 0)
        in_list = block[i] == "["
        if in_list:
            i = _next(block, i + 1)
            if block[i] == "]":  # an empty list: the model chose to call nothing
                return _expect_end(block, i + 1)
    while True:
        if block[i] != "{":
            raise _Malformed
        call = PartialToolCall()
        parsed.calls.append(call)
        i = _parse_call_object(block, i, call)
        if not in_list:
            rest = block[i:].lstrip(_WHITESPACE)
            if not separator or not rest.startswith(separator):
                return _expect_end(block, i)
            i = _next(block, len(block) - len(rest) + len(separator))
            parsed.resume = ResumePoint(i, False, parsed.first_call + len(parsed.calls))
            continue
        i = _next(block, i)
        if block[i] == "]":
            return _expect_end(block, i + 1)
        if block[i] != ",":
            raise _Malformed
        i = _next(block, i + 1)
        parsed.resume = ResumePoint(i, True, parsed.first_call + len(parsed.calls))


def _expect_end(block: str, i: int) -> None:
    if block[i:].strip(_WHITESPACE):
        raise _Malformed


def _parse_call_object(block: str, i: int, call: PartialToolCall) -> int:
    """Fill ``call`` from the object at ``block[i] == "{"``; return the index past its ``}``."""
    start, i = i, _next(block, i + 1)
    while block[i] != "}":
        if block[i] != '"':
            raise _Malformed
        key_end = json_value_end(block, i)
        if key_end is None:
            raise _TextEnded
        key = json.loads(block[i:key_end])
        i = _next(block, key_end)
        if block[i] != ":":
            raise _Malformed
        i = _next(block, i + 1)
        value_end = json_value_end(block, i)
        if key in ARGUMENT_KEYS:
            if block[i] != "{":
                raise _Malformed
            call.arguments = compact_json(block[i:value_end])
        if value_end is None:
            raise _TextEnded
        if key == "name":
            call.name = json.loads(block[i:value_end])
            if not isinstance(call.name, str):
                raise _Malformed
        i = _next(block, value_end)
        if block[i] == ",":
            i = _next(block, i + 1)
        elif block[i] != "}":
            raise _Malformed
    if call.name is None:
        raise _Malformed
    json.loads(block[start:i + 1])  # the values the scan skipped must be valid JSON too
    call.arguments = call.arguments or "{}"
    call.complete = True
    return i + 1

