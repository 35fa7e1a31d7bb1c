"""Tokenization off the event loop: a few worker threads, each with a tokenizer of its own.

A 5 MB prompt takes seconds to tokenize; done on the event loop it holds ``/health`` and every
running stream for that long. HF fast tokenizers release the GIL while they encode, so a thread is
enough to keep the loop free, but one tokenizer object must not be used by two threads at once:
``TokenizerPool.tokenizer`` hands every thread (the event loop's included) a deep copy of its own.

Invariant: a tokenizer copy is only ever used by one thread. Cost: one copy per worker thread
(made at start-up) plus one per other thread that asks (~0.1 s and a few MB each, made once).
"""

from __future__ import annotations

import asyncio
import copy
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# Characters of a probe that a lossless tokenizer must give back unchanged: runs of whitespace,
# combining marks, compatibility ligatures, CJK.
_PROBE = "a  b\t\tc\n\n d  \u00e9 e\u0301 \ufb03 \u65e5\u672c x"


class TokenizerPool:
    def __init__(self, tokenizer: Any, num_threads: int = 2) -> None:
        self._original = tokenizer
        self._local = threading.local()
        # The workers' copies are made now, at start-up: a copy takes ~0.1 s holding the GIL, which
        # would stall the event loop if made by a worker on its first request.
        self._copies: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(num_threads):
            self._copies.put(_private_copy(tokenizer))
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="pagedllm-tokenize",
                                            initializer=self._take_copy)
        self.max_chars_per_token = _max_chars_per_token(tokenizer)

    def _take_copy(self) -> None:
        self._local.tokenizer = self._copies.get_nowait()

    @property
    def tokenizer(self) -> Any:
        """The calling thread's own copy (made on its first call)."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = _private_copy(self._original)
        return tok

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread; inside it, ``self.tokenizer`` is that thread's copy."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _private_copy(tokenizer: Any) -> Any:
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # pragma: no cover - a tokenizer that cannot be copied is shared as it is
        return tokenizer


def _max_chars_per_token(tokenizer: Any) -> int | None:
    """An upper bound on the characters of text one token can cover, or None when the tokenizer
    drops or rewrites characters (then a text's length proves nothing about its token count).

    A lossless tokenizer's tokens cover every character of the text, and a vocabulary entry is at
    least as long as the text it covers (byte-level entries spell one character per byte,
    SentencePiece ones one per character), so ``tokens >= len(text) / longest entry``.
    """
    try:
        if tokenizer.decode(tokenizer.encode(_PROBE, add_special_tokens=False)) != _PROBE:
            return None
        return max(len(t) for t in tokenizer.get_vocab())
    except Exception:  # no get_vocab / encode: no bound
        return None
