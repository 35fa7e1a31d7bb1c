"""Split a reply into content and JSON tool calls, all at once or step by step while it streams."""

from __future__ import annotations

from .json_tool_calls import ParsedBlock, ResumePoint, make_tool_call_id, parse_calls

_WHITESPACE = " \t\n\r"


def _tag_prefix_length(text: str, start: int, tag: str | None) -> int:
    """Length of the longest end of ``text[start:]`` that could be the beginning of ``tag``."""
    if tag is None:
        return 0
    for length in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class ToolCallStream:
    """Reads a growing reply in which tool calls are JSON blocks between ``start_tag`` and
    ``end_tag`` (no ``end_tag``: a block runs to the end of the reply; no ``start_tag``: the reply
    is one block from its first character; ``separator``: as in ``parse_calls``), and returns
    OpenAI ``delta`` dicts.

    Invariant: ``text[:self._pos]`` is settled: its content has been returned, except
    ``self._held_whitespace``, and so have the calls of its blocks. Text that may still turn out
    to be a tag (``"<tool_"``) and trailing whitespace are held back; whitespace is sent with the
    next content, or at the end unless only tools were called (then ``content`` stays null).

    A block is returned as calls only when it is well formed: a block that cannot be JSON of one
    call object, a list of them or separated ones is returned as content when it closes. A call is
    announced (id, type, name) as soon as its name is complete, and its arguments follow as
    compact-JSON fragments; a block that breaks after a call was announced cannot be taken back
    and is dropped.

    Cost: each step re-reads the open block from the start of its first unfinished call, so a
    reply costs O(sum over calls of call length x steps inside it).
    """

    def __init__(self, start_tag: str | None, end_tag: str | None, separator: str | None = None):
        self.start_tag, self.end_tag, self.separator = start_tag, end_tag, separator
        self._pos = 0
        self._block_start: int | None = 0 if start_tag is None else None  # where the open block's tag begins
        self._sent_arguments: list[int] = []  # per announced call of the open block: chars of arguments sent
        self._resume: ResumePoint | None = None  # the open block's calls before it are complete and sent
        self._num_calls_closed = 0  # announced calls of the blocks already closed
        self._held_whitespace = ""
        self._sent_content = False

    @property
    def num_calls(self) -> int:
        return self._num_calls_closed + len(self._sent_arguments)

    def advance(self, text: str, final: bool) -> dict | None:
        """The delta that ``text`` (the reply so far; ``final``: all of it) adds to what was sent."""
        content: list[str] = []
        tool_calls: list[dict] = []
        while self._advance_once(text, final, content, tool_calls):
            pass
        if final and self._held_whitespace and (self._sent_content or not self.num_calls):
            content.append(self._held_whitespace)
            self._held_whitespace = ""
        delta = {}
        if content:
            delta["content"] = "".join(content)
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return delta or None

    def _advance_once(self, text: str, final: bool, content: list[str], tool_calls: list[dict]) -> bool:
        """Settle the next piece of ``text``; True while there may be more to settle."""
        if self._block_start is None:
            tag = -1 if self.start_tag is None else text.find(self.start_tag, self._pos)
            if tag == -1:
                end = len(text) - (0 if final else _tag_prefix_length(text, self._pos, self.start_tag))
                self._add_content(text[self._pos:end], content)
                self._pos = end
                return False
            self._add_content(text[self._pos:tag], content)
            self._block_start, self._pos = tag, tag + len(self.start_tag)
            return True
        close = text.find(self.end_tag, self._pos) if self.end_tag else -1
        body = text[self._pos:] if close == -1 else text[self._pos:close]
        closed = close != -1 or final
        parsed = parse_calls(body, self.separator, self._resume)
        usable = parsed.well_formed and (not closed or parsed.finished)
        if usable:
            self._send_calls(parsed, tool_calls)
            self._resume = parsed.resume
        if not closed:
            return False
        block_end = len(text) if close == -1 else close + len(self.end_tag)
        if not usable and not self._sent_arguments:
            self._add_content(text[self._block_start:block_end], content)
        self._num_calls_closed += len(self._sent_arguments)
        self._sent_arguments, self._resume, self._block_start, self._pos = [], None, None, block_end
        return block_end < len(text)

    def _send_calls(self, parsed: ParsedBlock, tool_calls: list[dict]) -> None:
        for k, call in enumerate(parsed.calls, start=parsed.first_call):
            index = self._num_calls_closed + k
            if k == len(self._sent_arguments):
                if call.name is None:  # the name comes first on the wire: wait for it
                    return
                tool_calls.append({"index": index, "id": make_tool_call_id(), "type": "function",
                                   "function": {"name": call.name, "arguments": call.arguments}})
                self._sent_arguments.append(len(call.arguments))
            elif len(call.arguments) > self._sent_arguments[k]:
                tool_calls.append({"index": index,
                                   "function": {"arguments": call.arguments[self._sent_arguments[k]:]}})
                self._sent_arguments[k] = len(call.arguments)

    def _add_content(self, text: str, content: list[str]) -> None:
        if not text:
            return
        text = self._held_whitespace + text
        body = text.rstrip(_WHITESPACE)
        self._held_whitespace = text[len(body):]
        if body:
            content.append(body)
            self._sent_content = True
