"""Reading and checking a request's JSON body before any handler sees it.

Three refusals happen here, each a 400/413 naming what is wrong, never a 500:
- a body larger than ``--max-request-body-bytes`` (413): the ``Content-Length`` header is checked
  first and the bytes are counted as they arrive, so an oversized body is never read whole;
- JSON nested deeper than ``MAX_JSON_DEPTH`` (a RecursionError in the parser or the validators);
- a string holding a lone UTF-16 surrogate (JSON allows ``"\\ud800"``; UTF-8, the tokenizer and the
  response encoder do not).
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request

from pagedllm.entrypoints.openai.errors import OpenAIError

# Deeper than any OpenAI request needs (a JSON schema in response_format is the deepest, ~10).
MAX_JSON_DEPTH = 64


def default_max_body_bytes(max_model_len: int) -> int:
    """4 MiB plus 64 bytes per token of context: a full-context prompt takes 4-8 bytes a token as
    text or as token ids, so this admits a batch of several such prompts and any chat history."""
    return 4 * 2**20 + 64 * max_model_len


def _too_large(limit: int, size: str) -> OpenAIError:
    return OpenAIError(413, f"request body is {size} bytes, more than the server's limit of {limit} bytes "
                       "(--max-request-body-bytes)", code="request_too_large")


async def read_body(request: Request, limit: int | None) -> bytes:
    """The body's bytes; a 413 as soon as it is known to be larger than ``limit``."""
    if limit is None:
        return await request.body()
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, declared)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, f"more than {size}")
        chunks.append(chunk)
    return b"".join(chunks)


def loads(raw: bytes) -> Any:
    """Parse JSON; malformed or too deeply nested text is a 400 (the latter naming the field)."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"malformed JSON in the request body: {e}", code="invalid_json") from e
    except RecursionError:
        field = _field_nesting_too_deep(raw.decode("utf-8", errors="replace"))
        where = f"{field}: nested" if field else "the request body is nested"
        raise OpenAIError(400, f"{where} deeper than {MAX_JSON_DEPTH} levels", param=field,
                          code="invalid_json") from None


# A JSON string (with its escapes) or a bracket: enough to follow the nesting of valid-looking JSON.
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _field_nesting_too_deep(text: str) -> str | None:
    """The top-level key whose value nests deeper than MAX_JSON_DEPTH (scanned only after the
    parser gave up, up to that point); None when the body itself is not an object."""
    depth, last_key = 0, None
    for m in _JSON_TOKEN.finditer(text):
        token = m.group()
        if token in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return last_key if text.lstrip().startswith("{") else None
        elif token in "]}":
            depth -= 1
        elif depth == 1:
            last_key = token[1:-1]
    return None


def check_values(data: dict) -> None:
    """Walk every value of a parsed body (iteratively: no recursion to overflow); a 400 naming the
    first field that nests deeper than ``MAX_JSON_DEPTH`` or holds a string that is not valid
    Unicode. Cost: one UTF-8 encode of every string, O(body size)."""
    stack: list[tuple[Any, tuple, int]] = [(v, (k,), 1) for k, v in data.items()]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise OpenAIError(400, f"{path[0]}: nested deeper than {MAX_JSON_DEPTH} levels",
                              param=str(path[0]))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(k, str):
                _check_text(k, (*path, k))
            stack.append((v, (*path, k), depth + 1))


def _check_text(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        raise OpenAIError(400, f"{_dotted(path)}: contains a lone surrogate (\\u{ord(bad):04x}) at character "
                          f"{e.start}; text must be valid Unicode", param=str(path[0])) from None


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)
