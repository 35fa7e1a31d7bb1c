"""StructuredOutputRequest: one request's grammar state, as the scheduler sees it (pure calls).

The scheduler never imports this module (core/ stays free of xgrammar); it calls ``is_ready()``,
``failed``, ``accept_tokens``, ``is_terminated()`` and ``jump_forward`` on
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
    accepted exactly the request's output tokens so far (jumped ones included) minus
    ``_deferred``, the tokens the scheduler handed to ``accept_tokens`` that the matcher has not
    seen yet; draft tokens it is walked over to fill their bitmask rows are rolled back before
    ``fill_bitmask`` returns. ``_terminated`` is whether the matcher is (or, once the deferred
    tokens are applied, will be) terminated, kept here: the scheduler asks after every step, and a
    call into xgrammar costs as much as accepting a token.

    Deferred accepts (requests that never jump): every token that reaches ``accept_tokens`` was
    sampled under this request's bitmask row, so the matcher will accept it, and a stop token it
    accepts terminates it (the grammar admits one only where it may end). The scheduler's update
    therefore only records the tokens (no xgrammar call per request); the manager applies the
    whole batch's in batched calls, in parallel chunks, before it starts the next fill
    (``take_for_fill``, ``apply_deferred``). A token the grammar refuses anyway (a bug: a row not
    applied) is found there: ``_refused`` is set and the next ``accept_tokens`` returns False, so
    the request is aborted one step later than with an immediate accept (one more token, sampled
    under a row that allows everything). A request that may jump accepts at once (the jump reads
    the state).
    Cost: ``accept_tokens`` is a list append (deferred) or one xgrammar call per token (jumping).
    """

    def __init__(self, compiled: Future, stop_token_ids: list[int] | None, new_matcher,
                 jump: JumpForward | None = None) -> None:
        self._compiled = compiled
        self._stop_token_ids = stop_token_ids
        self._new_matcher = new_matcher
        self._matcher = None
        self._stop_set: frozenset[int] = frozenset()  # the matcher's stop tokens, set with it
        self._terminated = False
        self._deferred: list[int] = []  # accepted by the scheduler, not yet by the matcher
        self._refused = False  # the matcher refused a deferred token: abort at the next accept
        self._jump = jump  # None: this request samples every token (jump-forward off, or logprobs)

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
        """The matcher, with every token accepted so far applied (the deferred ones now, one by
        one: the manager applies a step's in one batched call before this is asked)."""
        matcher, token_ids = self.take_for_fill()
        if token_ids and not self._refused:
            self._accept_now(token_ids)
        return matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance by the request's new tokens (deferred unless the request may jump: class doc);
        False if the grammar refused one (then, or in the batch that applied the deferred ones:
        the matcher is unchanged from the first refused one on) or has already terminated."""
        if self._refused or self._terminated:
            return False
        if self._matcher is None:
            self._create_matcher()
        if self._jump is not None:
            return self._accept_now(token_ids)
        self._deferred += token_ids  # applied by the next start_bitmask (manager.py), or by ``matcher``
        if not self._stop_set.isdisjoint(token_ids):
            self._terminated = True
        return True

    def _accept_now(self, token_ids: list[int]) -> bool:
        matcher = self._matcher
        for token_id in token_ids:
            if not matcher.accept_token(token_id):
                self.refuse(token_id)
                return False
            if token_id in self._stop_set:
                self._terminated = matcher.is_terminated()
        return True

    def take_for_fill(self) -> tuple[object, list[int]]:
        """The matcher (created if need be) and the deferred tokens, handed to the manager, which
        applies them (``apply_deferred``) before it fills the next row."""
        if self._matcher is None:
            self._create_matcher()
        token_ids, self._deferred = self._deferred, []
        return self._matcher, token_ids

    def _create_matcher(self) -> None:
        self._matcher = self._new_matcher(self._compiled.result(), self._stop_token_ids)
        self._stop_set = frozenset(self._matcher.stop_token_ids)

    def refuse(self, token_id: int) -> None:
        """The grammar refused ``token_id``: the next ``accept_tokens`` returns False."""
        logger.error("structured output: token %d refused by the grammar", token_id)
        self._refused = True

    def needs_fill(self) -> bool:
        """Whether the next bitmask row comes from the matcher (False: terminated or refused, the
        row allows everything: the request finishes, or is aborted, in the next update)."""
        return not (self._terminated or self._refused)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected drafts)."""
        if num_tokens:
            self.matcher.rollback(num_tokens)  # applies the deferred tokens first
            self._terminated = self._matcher.is_terminated()

    def jump_forward(self, max_tokens: int) -> list[int]:
        """The tokens the grammar forces next, at most ``max_tokens``, already accepted by the
        matcher (jump_forward.py); [] when none is forced or jump-forward is off for the request."""
        if self._jump is None or max_tokens <= 0:
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



def apply_deferred(matchers: list, token_lists: list[list[int]], batch_accept) -> dict[int, int]:
    """Advance ``matchers[i]`` by ``token_lists[i]`` (the deferred tokens that
    ``StructuredOutputRequest.take_for_fill`` handed over): one ``batch_accept(matchers, token_ids)
    -> refused indices`` call per token position, so one call for a step without drafts. Returns
    {index: the token refused} for the matchers that refused one (their later tokens dropped). Cost:
    O(len(matchers)) Python plus the batched call (about as much C++ as one accept per matcher)."""
    pending = [i for i, token_ids in enumerate(token_lists) if token_ids]
    refused: dict[int, int] = {}
    position = 0
    while pending:
        for j in batch_accept([matchers[i] for i in pending], [token_lists[i][position] for i in pending]):
            refused[pending[j]] = token_lists[pending[j]][position]
        position += 1
        pending = [i for i in pending if len(token_lists[i]) > position and i not in refused]
    return refused
