"""Prompt normalisation and validation: user prompt -> (prompt text, token ids).

Accepts a str, ``{"prompt": str}``, ``{"prompt_token_ids": [...]}`` or a list of ints. Every
rejection is a ValueError/TypeError naming the field, raised before anything is queued.
"""

from __future__ import annotations

from typing import Any

from pagedllm.sampling_params import SamplingParams

PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")


def _check_prompt_dict_keys(prompt: dict) -> None:
    """Refuse what this engine would otherwise drop silently: multimodal data and any other key."""
    if "multi_modal_data" in prompt:
        raise ValueError("multi_modal_data is not supported: this engine serves text-only models")
    unknown = sorted(str(k) for k in prompt if k not in PROMPT_DICT_KEYS)
    if unknown:
        raise ValueError(f"prompt dict keys {unknown} are not supported (allowed: {list(PROMPT_DICT_KEYS)})")


def _all_token_ids(values: list | tuple) -> bool:
    """Whether every value is an int and none a bool. The common case (plain ints only) is one
    C-level pass (``map(type)``); other int subclasses take the per-value check."""
    types = set(map(type, values))
    if types <= {int}:
        return True
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)


def tokenize_prompt(prompt: Any, tokenizer, tokenization_kwargs: dict | None = None) -> tuple[str | None, list[int]]:
    if isinstance(prompt, str):
        text, ids = prompt, None
    elif isinstance(prompt, dict):
        _check_prompt_dict_keys(prompt)
        if "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            text, ids = prompt["prompt"], None
        else:
            raise ValueError("prompt dict must contain 'prompt' or 'prompt_token_ids'")
    elif isinstance(prompt, (list, tuple)) and _all_token_ids(prompt):
        text, ids = None, list(prompt)
    else:
        raise TypeError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
    if ids is None:
        if tokenizer is None:
            raise ValueError("prompt must be given as token ids: the engine has no tokenizer (skip_tokenizer_init)")
        if not isinstance(text, str):
            raise TypeError(f"prompt must be a string, got {type(text).__name__}")
        if not text:
            raise ValueError("prompt must not be empty")
        kwargs = dict(tokenization_kwargs or {})
        kwargs.setdefault("add_special_tokens", True)
        ids = tokenizer.encode(text, **kwargs)
    else:
        if not isinstance(ids, (list, tuple)) or not _all_token_ids(ids):
            raise TypeError("prompt_token_ids must be a list of integers")
        ids = list(ids)
    if not ids:
        raise ValueError("prompt must not be empty (it has no tokens)")
    return text, ids


def batch_token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's token ids with the special tokens (what ``tokenizer.encode(text)`` gives), in one
    batched call. A fast tokenizer whose Rust backend has no truncation, padding or special-token
    splitting of its own runs ``encode_batch_fast`` directly: no character offsets, no per-text
    Python conversion into a ``BatchEncoding``. Any other tokenizer runs its batched ``__call__``."""
    backend = getattr(tokenizer, "_tokenizer", None)
    encode_batch_fast = getattr(backend, "encode_batch_fast", None)
    if (encode_batch_fast is not None and backend.truncation is None and backend.padding is None
            and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False))):
        return [encoding.ids for encoding in encode_batch_fast(texts, add_special_tokens=True)]
    return tokenizer(texts, add_special_tokens=True)["input_ids"]


def validate_prompt(ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> int:
    """Check ids and lengths; return the effective max_tokens (clipped to the context length)."""
    bad = [t for t in ids if t < 0 or t >= vocab_size]
    if bad:
        raise ValueError(f"prompt_token_ids contains ids outside the vocabulary (size {vocab_size}): {bad[:5]}")
    if params.truncate_prompt_tokens is not None:
        ids[:] = ids[-params.truncate_prompt_tokens :]
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt is too long: {len(ids)} tokens, but max_model_len is {max_model_len} "
            "(the prompt plus at least one generated token must fit)"
        )
    params.verify_vocab(vocab_size)
    room = max_model_len - len(ids)
    return room if params.max_tokens is None else min(params.max_tokens, room)
