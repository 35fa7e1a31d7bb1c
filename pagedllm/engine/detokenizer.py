"""Incremental detokenization, correct across multi-byte characters and BPE/sentencepiece merges.

Decoding one token at a time is wrong for byte-level BPE (a character may span tokens) and for
sentencepiece (a leading space depends on the previous token). We decode a short window instead:
``prefix_offset..read_offset`` is text already emitted; decoding ``prefix_offset..end`` and
stripping the prefix's decoding yields the new text. If the new text ends in U+FFFD (an
incomplete UTF-8 sequence) we wait for more tokens. Cost: two decodes of a few tokens per step.
"""

from __future__ import annotations

_INCOMPLETE = "\ufffd"
_INITIAL_PREFIX_TOKENS = 5
# Hugging Face tokenizer classes whose ``_decode`` is the Rust ``tokenizers.Tokenizer.decode`` plus an
# optional clean-up of spaces (``tokenization_utils_fast`` before transformers 5).
_BACKEND_DECODE_MODULES = ("transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast")


def backend_decode(tokenizer):
    """``tokenizers.Tokenizer.decode`` of ``tokenizer`` when the wrapper's ``decode(ids,
    skip_special_tokens=...)`` returns exactly its result, else None.

    That holds for a Hugging Face fast tokenizer that overrides neither ``decode`` nor ``_decode``
    and does not clean up tokenization spaces; its ``spaces_between_special_tokens`` is ignored
    there too. Calling the Rust decoder directly skips ~2 us of Python per call (two calls per
    sequence per step).
    """
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    wrapper, inner = getattr(cls, "decode", None), getattr(cls, "_decode", None)
    if backend is None or wrapper is None or inner is None:
        return None
    if wrapper.__module__ != "transformers.tokenization_utils_base" or inner.__module__ not in _BACKEND_DECODE_MODULES:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return backend.decode if isinstance(backend, Tokenizer) else None


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._backend_decode = backend_decode(tokenizer)
        # Seed the window with the prompt's tail so the first output token gets its correct spacing.
        self.token_ids: list[int] = list(prompt_token_ids[-_INITIAL_PREFIX_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        kwargs = {"skip_special_tokens": self.skip_special_tokens}
        if not self.spaces_between_special_tokens:
            kwargs["spaces_between_special_tokens"] = False
        try:
            return self.tokenizer.decode(ids, **kwargs)
        except TypeError:  # tokenizers without that keyword
            kwargs.pop("spaces_between_special_tokens", None)
            return self.tokenizer.decode(ids, **kwargs)

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (may be "" while a character is partial)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(_INCOMPLETE):
            delta = full_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self.output_text += delta
            return delta
        return ""
