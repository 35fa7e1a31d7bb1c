"""Chat messages -> prompt token ids through the tokenizer's (or a given) chat template.

Shared by the offline ``LLM.chat`` and the server's ``/v1/chat/completions`` and ``/tokenize``.
``text_messages`` is the one validation of a conversation (roles, content, text-only parts, tool
calls and results), run before any template or tokenizer work. Tools reach the model through the
template, or through the system prompt when the template ignores them (see ``apply_chat_template``).
"""

from __future__ import annotations

import functools
import json
from typing import Literal, get_args

import jinja2
import jinja2.meta

# OpenAI's roles ("function" is the deprecated form of "tool").
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
ROLES = get_args(Role)


def text_messages(messages: list[dict]) -> list[dict]:
    """The conversation with each content as one string; ValueError naming ``messages[i]`` for an
    unknown role, a missing content (only an assistant message may have none, as OpenAI), a
    non-text part (multimodal input is not supported), a malformed ``tool_calls`` (assistant
    messages only) or a tool result without its ``tool_call_id``.

    The JSON-string ``arguments`` of an assistant's tool calls become objects, as chat templates
    expect (and vLLM does); an argument string that is not a JSON object stays a string."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    normalised = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be a dict with a 'role'")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {m['role']!r}")
        content = m.get("content")
        if isinstance(content, list):
            content = _join_text_parts(i, content)
        elif content is None:
            if m["role"] != "assistant":
                raise ValueError(f"messages[{i}].content is required for a {m['role']!r} message")
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        message = {**m, "content": content}
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise ValueError(f"messages[{i}].tool_calls: only an assistant message calls tools")
            message["tool_calls"] = [_template_tool_call(f"messages[{i}].tool_calls[{k}]", call)
                                     for k, call in enumerate(m["tool_calls"])]
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise ValueError(f"messages[{i}].tool_call_id is required for a 'tool' message (the id of the call "
                             "it answers)")
        normalised.append(message)
    return normalised


def _template_tool_call(where: str, call) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else arguments
    return {**call, "type": call.get("type", "function"), "function": {**function, "arguments": arguments}}


def _join_text_parts(i: int, content: list) -> str:
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text":
            parts.append(part.get("text", ""))
        elif isinstance(part, str):
            parts.append(part)
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"messages[{i}].content: a {kind!r} part is not supported "
                             "(multimodal input is not implemented: text parts only)")
    return "".join(parts) if len(parts) <= 1 else "\n".join(parts)


# Arguments of transformers' apply_chat_template and variables other request fields set: a
# chat_template_kwargs entry may not replace them.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_chat_template_kwargs(kwargs) -> dict:
    """The extra template variables (``{}`` for None); ValueError naming ``chat_template_kwargs``."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be an object, got {type(kwargs).__name__}")
    for key in kwargs:
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"chat_template_kwargs.{key}: reserved (set by the request itself, e.g. its "
                             "tools, chat_template or add_generation_prompt fields)")
    return kwargs


def apply_chat_template(tokenizer, messages: list[dict], chat_template: str | None = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[int]:
    """Render a conversation to token ids. Message content may be a str or a list of text parts.

    ``tools`` (OpenAI function tools) go to the template as ``tools``; a template that never reads
    that variable gets them in the system prompt instead (``tools_in_system_prompt``), and one
    that never reads ``tool_calls`` gets the assistant's calls and the tool results as hermes-style
    text (``tool_turns_as_text``), so that the model sees the tools, its calls and their results
    whatever its template. ``chat_template_kwargs`` are further template variables."""
    normalised = text_messages(messages)  # first: refusals need no tokenizer
    extra = check_chat_template_kwargs(chat_template_kwargs)
    template = tokenizer.get_chat_template(chat_template, tools or None)
    if tools and not template_reads(template, "tools"):
        normalised = tools_in_system_prompt(normalised, tools)
    if not template_reads(template, "tool_calls"):
        normalised = tool_turns_as_text(normalised)
    text = tokenizer.apply_chat_template(
        normalised, tools=tools or None, chat_template=template, tokenize=False,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message, **extra,
    )
    return tokenizer.encode(text, add_special_tokens=False)


@functools.lru_cache(maxsize=16)
def template_reads(template: str, name: str) -> bool:
    """Whether a Jinja chat template reads the variable ``name`` (``tools``) or an attribute or key
    of that name (``message.tool_calls``). Cost: a Jinja parse per (template, name), cached."""
    if name == "tools":
        return name in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    return name in template


def tools_in_system_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation with the tools described in its system message (one added if it has none),
    in the hermes format: signatures in ``<tools>``, calls answered in ``<tool_call>`` tags."""
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    block = HERMES_TOOLS_PROMPT.format(signatures=signatures)
    if messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


HERMES_TOOLS_PROMPT = """# Tools

You can call functions to help with the user's request. Their signatures, one JSON object per line, \
are inside <tools></tools>:
<tools>
{signatures}
</tools>

To call a function, reply with a JSON object holding its name and its arguments inside \
<tool_call></tool_call> tags, one block per call:
<tool_call>
{{"name": "function name", "arguments": {{"argument name": "value"}}}}
</tool_call>
The result of each call comes back inside <tool_response></tool_response> tags."""


def tool_turns_as_text(messages: list[dict]) -> list[dict]:
    """The conversation with each assistant tool call appended to its content as a hermes
    ``<tool_call>`` block and each tool result wrapped in ``<tool_response>`` tags (for templates
    that render only ``content``)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            blocks = [_tool_call_text(call["function"]) for call in m["tool_calls"]]
            m = {**m, "content": "\n".join(([m["content"]] if m["content"] else []) + blocks)}
        elif m["role"] == "tool":
            m = {**m, "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    return out


def _tool_call_text(function: dict) -> str:
    call = {"name": function["name"], "arguments": function.get("arguments", {})}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"
