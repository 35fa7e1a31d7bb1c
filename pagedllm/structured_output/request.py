"""StructuredOutputRequest: one request's grammar state, as the scheduler sees it (pure calls).

The scheduler never imports this module (core/ stays free of xgrammar); it calls ``is_ready()``,
``failed``, ``accept_tokens``, ``is_terminated()``, ``may_jump`` and ``jump_forward`` on
``Request.structured_output_request``.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

import numpy as np

from pagedllm.structured_output.jump_forward import JumpForward

logger = logging.getLogger("pagedllm")


class StructuredOutputRequest:
    """The compiled grammar (a future from the manager's pool) and the request's matcher.

    Invariant: once the future is done and succeeded, ``matcher`` (created on first use) has
    accepted the request's output tokens so far (jumped ones included) except ``_pending``, the
    tail the scheduler gave ``accept_tokens`` since: the manager accepts the pending tokens of a
    whole step in batched, parallel calls before it fills the bitmask (``take_pending``), and any
    other use of ``matcher`` accepts them first, one by one. Draft tokens it is walked over to fill
    their bitmask rows are rolled back before ``fill_bitmask`` returns. ``_refused``: the grammar
    refused a pending token (the bitmask was not applied: never expected); the matcher stays before
    it and the next ``accept_tokens`` answers False. ``_terminated`` is the matcher's
    ``is_terminated()``, kept here: the grammar terminates only by accepting one of ``_stop_set``,
    so such a token is accepted at once (not left pending) and asks xgrammar again, as does a
    rollback; the scheduler asks after every step, and a call into xgrammar costs as much as
    accepting a token.
    Cost: ``accept_tokens`` is a list append for a token that cannot end the grammar; each
    matcher call is one xgrammar call (microseconds) per token.
    """

    def __init__(self, compiled: Future, stop_token_ids: list[int] | None, new_matcher,
                 jump: JumpForward | None = None) -> None:
        self._compiled = compiled
        self._stop_token_ids = stop_token_ids
        self._new_matcher = new_matcher
        self._matcher = None
        self._stop_set: frozenset[int] = frozenset()  # the matcher's stop tokens, set with it
        self._pending: list[int] = []  # accepted by the scheduler, not yet by the matcher
        self._refused = False
        self._terminated = False
        self._jump = jump  # None: this request samples every token (jump-forward off, or logprobs)
        self.may_jump = jump is not None  # the scheduler asks for a jump after each step only then

    @property
    def compiled(self) -> Future:
        """The future of the compiled grammar (shared by the requests with the same constraint)."""
        return self._compiled

    def is_ready(self) -> bool:
        """The grammar is compiled, or failed to compile (``failed`` says which)."""
        return self._compiled.done()

    @property
    def failed(self) -> bool:
        return self._compiled.done() and self._compiled.exception() is not None

    @property
    def matcher(self):
        """The matcher, having accepted every token given to ``accept_tokens`` (but refused ones)."""
        matcher = self._matcher or self._create_matcher()
        if self._pending:
            self._accept_pending()
        return matcher

    def _create_matcher(self):
        self._matcher = self._new_matcher(self._compiled.result(), self._stop_token_ids)
        self._stop_set = frozenset(self._matcher.stop_token_ids)
        return self._matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance by the request's new tokens; False if the grammar refused one of them or an
        earlier pending one (the matcher then stays before the first refused token). A token that
        cannot end the grammar is only queued (``_pending``): the refusal of such a token, never
        expected since the step's bitmask allowed it, is reported by the call after it is tried."""
        if self._refused or self._terminated:
            return False
        if self._matcher is None:
            self._create_matcher()
        self._pending.extend(token_ids)
        if not self._stop_set.isdisjoint(token_ids):  # it may end the grammar: know now
            self._accept_pending()
        return not self._refused

    def _accept_pending(self) -> None:
        """Accept the pending tokens one by one (the rare path: drafts, jumps, stop tokens)."""
        pending, self._pending = self._pending, []
        matcher = self._matcher
        for token_id in pending:
            if not matcher.accept_token(token_id):
                self.refuse(token_id)
                return
            if token_id in self._stop_set:
                self._terminated = matcher.is_terminated()

    def take_pending(self) -> tuple[object, list[int]]:
        """The matcher (created if need be) and the pending tokens, now the caller's to give it
        (the manager's batched accept; a refusal is reported back with ``refuse``)."""
        matcher = self._matcher or self._create_matcher()
        pending, self._pending = self._pending, []
        return matcher, pending

    def accept_now(self, token_ids: list[int]) -> None:
        """Give ``token_ids`` (taken with ``take_pending``) to the matcher one by one."""
        self._pending = token_ids + self._pending
        self._accept_pending()

    def refuse(self, token_id: int) -> None:
        logger.error("structured output: token %d refused by the grammar", token_id)
        self._refused = True

    @property
    def refused(self) -> bool:
        """The grammar refused a token given to ``accept_tokens`` (the request is to be aborted)."""
        return self._refused

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected drafts)."""
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self._terminated = self._matcher.is_terminated()

    def jump_forward(self, max_tokens: int) -> list[int]:
        """The tokens the grammar forces next, at most ``max_tokens``, already accepted by the
        matcher (jump_forward.py); [] when none is forced or jump-forward is off for the request."""
        if not self.may_jump or max_tokens <= 0:
            return []
        matcher = self.matcher
        text = matcher.find_jump_forward_string()
        if not text:
            return []
        accepted: list[int] = []
        for token_id in self._jump.tokenize(text)[:max_tokens]:
            if not matcher.accept_token(token_id):
                break
            accepted.append(token_id)
            if token_id in self._stop_set:
                self._terminated = matcher.is_terminated()
        self._jump.record(len(accepted))
        return accepted

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self._terminated

    def fill_bitmask(self, bitmask: np.ndarray, first_row: int, draft_token_ids: list[int]) -> None:
        """Fill ``bitmask[first_row + j]`` for the step's ``len(draft_token_ids) + 1`` positions:
        the next token, then the token after each draft (walked over, then rolled back). Rows after
        a draft the grammar refuses allow everything (verification rejects that draft anyway)."""
        matcher = self.matcher
        num_accepted = 0
        for j in range(len(draft_token_ids) + 1):
            row = first_row + j
            if j > num_accepted or matcher.is_terminated():
                bitmask[row] = -1
            else:
                matcher.fill_next_token_bitmask(bitmask, row)
            if j < len(draft_token_ids) and j == num_accepted and matcher.accept_token(draft_token_ids[j]):
                num_accepted += 1
        self.rollback(num_accepted)
