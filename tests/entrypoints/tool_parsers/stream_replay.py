"""Feed a reply to a tool parser in small random pieces and put its deltas back together."""

from __future__ import annotations

import random


def random_pieces(text: str, seed: int, max_piece: int = 5) -> list[str]:
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, max_piece)
        pieces.append(text[i:i + n])
        i += n
    return pieces


def replay(parser, text: str, seed: int) -> tuple[list[dict], str | None, list[dict]]:
    """Stream ``text`` through ``parser``; return (deltas, content, tool calls) as a client that
    concatenates ``delta.content`` and each call's ``function.arguments`` would see them."""
    deltas, previous = [], ""
    for piece in random_pieces(text, seed):
        current = previous + piece
        delta = parser.extract_tool_calls_streaming(previous, current, piece, request=None)
        deltas.append(delta)
        previous = current
    deltas.append(parser.finish_streaming(text))
    deltas = [d for d in deltas if d is not None]
    content = "".join(d.get("content", "") for d in deltas) or None
    calls: dict[int, dict] = {}
    for delta in deltas:
        assert set(delta) <= {"content", "tool_calls"} and delta, delta
        for entry in delta.get("tool_calls", []):
            if entry["index"] not in calls:  # the first delta of a call announces it
                assert entry["index"] == len(calls), "calls are announced in order"
                assert entry["id"].startswith("chatcmpl-tool-") and entry["type"] == "function", entry
                calls[entry["index"]] = {"id": entry["id"], "type": "function",
                                         "function": {"name": entry["function"]["name"], "arguments": ""}}
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}, entry
            calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    return deltas, content, [calls[i] for i in range(len(calls))]


def without_ids(tool_calls: list[dict]) -> list[dict]:
    return [{"type": c["type"], "function": c["function"]} for c in tool_calls]
