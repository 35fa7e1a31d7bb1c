"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status."""

from __future__ import annotations

import json
import re

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "overloaded_error",
}


class OpenAIError(Exception):
    """An error to send to the client as it is."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\b")


def bad_request(exc: BaseException, known_fields: set[str] | None = None, default_param: str | None = None
                ) -> OpenAIError:
    """A 400 from a ValueError/TypeError whose message starts with the offending field's name."""
    message = str(exc) or type(exc).__name__
    m = _FIELD.match(message)
    param = default_param
    if m and (known_fields is None or m.group(1) in known_fields):
        param = m.group(1)
    return OpenAIError(400, message, param=param)


def from_validation_errors(errors: list[dict]) -> OpenAIError:
    """A 400 from pydantic's error list, naming the first offending top-level field as ``param``."""
    if not errors:
        return OpenAIError(400, "invalid request body")
    first = errors[0]
    # Drop pydantic's union-member tags ("str", "list[int]") from the path: they are not fields.
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_type_tag(p)]
    param = loc[0] if loc else None
    path = ".".join(loc)
    msg = first.get("msg", "invalid value")
    if first.get("type") == "value_error":  # a validator's own ValueError: its message as written
        msg = msg.removeprefix("Value error, ")
    same_field = [e for e in errors if [p for p in e.get("loc", ()) if p != "body"][:1] == [param]]
    if first.get("type") == "missing":
        message = f"{path} is required"
    elif len(same_field) > 1 and any(_is_type_tag(p) for p in first.get("loc", ())):
        message = f"{param}: invalid type or value (got {_short(first.get('input'))})"
    elif path:
        message = f"{path}: {msg} (got {_short(first.get('input'))})"
    else:
        message = msg
    others = len({tuple(e.get("loc", ())[:2]) for e in errors}) - 1 if len(same_field) < len(errors) else 0
    if others > 0:
        message += f" (and {others} more error{'s' if others > 1 else ''})"
    return OpenAIError(400, message, param=param)


def _is_type_tag(part) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list", "none")
                                      or "[" in part or part.startswith("function-"))


def _short(value) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
