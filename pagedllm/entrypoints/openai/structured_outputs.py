"""The request fields that constrain the output -> one ``StructuredOutputsParams`` for the engine.

A request may ask for a constraint in one of several spellings: OpenAI's ``response_format``
(``json_object`` / ``json_schema``), vLLM's extra body ``structured_outputs`` (its dict form) and
the older vLLM aliases ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``;
on chat, a ``required`` or named ``tool_choice`` adds the JSON schema of the tool calls. At most
one of them may be set (a second one is a 400 naming it): they would be different grammars for
the same text.

Every error names the field the client used, not the engine's name for the constraint kind: the
engine parses the schema / regex / grammar at ``add_request`` and raises ``ValueError("json is
not a valid JSON schema: ...")``; ``rename_constraint_error`` turns that into
``"guided_json: json is not a valid JSON schema: ..."`` (param ``guided_json``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.sampling_params import CONSTRAINT_KINDS, StructuredOutputsParams

# The request fields that ask for a constraint, in the order a conflict is reported.
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")
# guided_decoding_backend values that name the one backend here (vLLM's "auto" picks it too).
BACKENDS = ("xgrammar", "auto")
# Keys of vLLM's structured_outputs dict that pagedllm reads. ``disable_fallback`` is accepted:
# there is no other backend to fall back to, so every request already behaves as it asks.
_STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                            "whitespace_pattern", "disable_fallback")
_JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")


@dataclass(frozen=True)
class Constraint:
    """A request's output constraint and the request field that asked for it (errors name it)."""

    params: StructuredOutputsParams
    field: str


def request_constraint(fields: dict[str, Any], tool_schema: dict | None = None) -> Constraint | None:
    """The constraint asked for by ``fields`` (the request's constraint fields by name, None when
    unset) and, on chat, by a forced ``tool_choice`` (``tool_schema``); None if nothing constrains
    the output. ValueError/TypeError naming the field on a malformed or conflicting constraint."""
    check_backend(fields.get("guided_decoding_backend"))
    found: list[Constraint] = []
    if tool_schema is not None:  # first: a conflict names the other field, the one to drop
        found.append(Constraint(_with_field_name("tools", _tool_calls_constraint, tool_schema), "tool_choice"))
    for name in CONSTRAINT_FIELDS:
        value = fields.get(name)
        if value is None:
            continue
        params = _with_field_name(name, _PARSERS[name], value)
        if params is not None:
            found.append(Constraint(params, name))
    if len(found) > 1:
        first, second = found[0].field, found[1].field
        raise ValueError(f"{second}: cannot be combined with {first} (a request takes one output constraint)")
    return found[0] if found else None


def check_backend(backend: Any) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"guided_decoding_backend: only xgrammar is available (or 'auto', which picks it), "
                         f"got {backend!r}")


def rename_constraint_error(error: Exception, constraint: Constraint | None) -> Exception:
    """The engine's ValueError about the constraint (it starts with the kind: ``json``, ``regex``,
    ...) restated with the request field's name in front; any other error as it is."""
    message = str(error)
    if constraint is None:
        return error
    kind = constraint.params.kind
    if any(message.startswith(prefix) for prefix in (f"{kind} ", f"{kind}:", "structured_outputs")):
        field = "tools" if constraint.field == "tool_choice" else constraint.field
        return type(error)(f"{field}: {message}")
    return error


def _with_field_name(field: str, build, value):
    """``build(value)``, its ValueError/TypeError restated to start with ``field``."""
    try:
        return build(value)
    except (ValueError, TypeError) as e:
        message = str(e)
        raise type(e)(message if message.startswith(field) else f"{field}: {message}") from e


def _tool_calls_constraint(schema: dict) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema)


def _response_format(value: Any) -> StructuredOutputsParams | None:
    if not isinstance(value, dict):
        raise TypeError(f"response_format must be an object with a 'type', got {type(value).__name__}")
    kind = value.get("type")
    extra = set(value) - {"type", "json_schema"}
    if extra:
        raise ValueError(f"response_format: unknown key {sorted(extra)[0]!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        return StructuredOutputsParams(json=_json_schema(value.get("json_schema")))
    raise ValueError(f"response_format.type must be one of text, json_object, json_schema; got {kind!r}")


def _json_schema(spec: Any) -> dict:
    """OpenAI's ``{"name", "schema", "description", "strict"}``. The output always follows the
    schema (a grammar enforces it), so ``strict`` false asks for less than it gets."""
    if not isinstance(spec, dict):
        raise ValueError("response_format.json_schema must be an object with 'name' and 'schema'")
    unknown = set(spec) - set(_JSON_SCHEMA_KEYS)
    if unknown:
        raise ValueError(f"response_format.json_schema: unknown key {sorted(unknown)[0]!r}")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("response_format.json_schema.name must be a non-empty string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ValueError("response_format.json_schema.strict must be a boolean")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ValueError("response_format.json_schema.schema must be a JSON schema object")
    return schema


def _structured_outputs(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise TypeError(f"structured_outputs must be an object (vLLM's StructuredOutputsParams), "
                        f"got {type(value).__name__}")
    for key in value:
        if key not in _STRUCTURED_OUTPUTS_KEYS:
            raise ValueError(f"structured_outputs.{key}: not supported (supported: "
                             f"{', '.join(_STRUCTURED_OUTPUTS_KEYS)})")
    disable_fallback = value.get("disable_fallback")
    if disable_fallback is not None and not isinstance(disable_fallback, bool):
        raise ValueError("structured_outputs.disable_fallback must be a boolean")
    kwargs = {k: v for k, v in value.items() if k != "disable_fallback" and v is not None}
    try:
        return StructuredOutputsParams(**kwargs)
    except (ValueError, TypeError) as e:
        message = str(e)
        if message.split(" ", 1)[0] in (*CONSTRAINT_KINDS, "disable_any_whitespace", "whitespace_pattern"):
            message = f"structured_outputs.{message}"  # "regex must be ..." -> "structured_outputs.regex must be ..."
        raise type(e)(message) from e


_PARSERS = {
    "response_format": _response_format,
    "structured_outputs": _structured_outputs,
    "guided_json": lambda v: StructuredOutputsParams(json=v),
    "guided_regex": lambda v: StructuredOutputsParams(regex=v),
    "guided_choice": lambda v: StructuredOutputsParams(choice=v),
    "guided_grammar": lambda v: StructuredOutputsParams(grammar=v),
}
