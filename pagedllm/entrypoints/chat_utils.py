"""Chat messages -> prompt token ids through the tokenizer's (or a given) chat template.

Shared by the offline ``LLM.chat`` and the server's ``/v1/chat/completions`` and ``/tokenize``.
``text_messages`` is the one validation of a conversation (roles, content, text-only parts), run
before any template or tokenizer work.
"""

from __future__ import annotations

from typing import Literal, get_args

# OpenAI's roles ("function" is the deprecated form of "tool").
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
ROLES = get_args(Role)


def text_messages(messages: list[dict]) -> list[dict]:
    """The conversation with each content as one string; ValueError naming ``messages[i]`` for an
    unknown role, a missing content (only an assistant message may have none, as OpenAI) or a
    non-text part (multimodal input is not supported)."""
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
        normalised.append({**m, "content": content})
    return normalised


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


def apply_chat_template(tokenizer, messages: list[dict], chat_template: str | None = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
    """Render a conversation to token ids. Message content may be a str or a list of text parts."""
    normalised = text_messages(messages)  # first: refusals need no tokenizer
    text = tokenizer.apply_chat_template(
        normalised, chat_template=chat_template, tokenize=False,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message,
    )
    return tokenizer.encode(text, add_special_tokens=False)
