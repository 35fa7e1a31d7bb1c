"""Chat messages -> prompt token ids through the tokenizer's (or a given) chat template.

Shared by the offline ``LLM.chat`` and the server's ``/v1/chat/completions`` and ``/tokenize``.
"""

from __future__ import annotations


def apply_chat_template(tokenizer, messages: list[dict], chat_template: str | None = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
    """Render a conversation to token ids. Message content may be a str or a list of text parts."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    normalised = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be a dict with a 'role'")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    parts.append(part.get("text", ""))
                elif isinstance(part, str):
                    parts.append(part)
                else:
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"messages[{i}].content: a {kind!r} part is not supported "
                                     "(text-only models: only 'text' parts)")
            content = "".join(parts) if len(parts) <= 1 else "\n".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        normalised.append({**m, "content": content})
    text = tokenizer.apply_chat_template(
        normalised, chat_template=chat_template, tokenize=False,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message,
    )
    return tokenizer.encode(text, add_special_tokens=False)
