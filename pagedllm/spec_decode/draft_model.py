"""Draft-model proposer: a second, smaller model with the target's vocabulary drafts k tokens.

The draft keeps its own paged KV cache (its own layers and head shapes) with its own block pool:
``_DraftState`` gives each request a row (block table, and the token ids whose KV the draft's
cache holds). Each step, over the whole batch at once:

1. catch up: one forward over every request's tokens from the first position where what the
   draft computed differs from what was accepted (rejected drafts are simply recomputed) to its
   last known token; the argmax after it is the first draft. After the first step of a request
   this is 1 or 2 tokens per request;
2. k - 1 single-token steps over the batch, each taking the previous step's argmax as its input
   on the device (no host round trip between them);
3. one copy of the ``[batch, k]`` drafts to the host.

Drafts are the argmax (a point mass: see rejection_sampler.py), whatever the request's sampling
parameters. How a forward runs (eager, or the draft's own CUDA graphs: decode graphs for step 2,
two-query graphs for step 1) is the worker's business: ``DraftSteps``, implemented in
``worker/proposer.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np
import torch

from pagedllm.spec_decode.interface import ProposeInput


class DraftSteps(Protocol):
    """Runs the draft model over a batch of its rows (``worker/proposer.DraftModelRunner``)."""

    max_num_tokens: int  # the most tokens one ``run`` takes

    def set_blocks(self, row: int, first_col: int, block_ids: list[int]) -> None:
        """Row ``row``'s block table gains ``block_ids`` from column ``first_col`` on."""
        ...

    def run(self, token_ids: np.ndarray, block_table: np.ndarray, rows: np.ndarray, num_sched: np.ndarray,
            seq_lens: np.ndarray, last_token: torch.Tensor | None = None) -> torch.Tensor:
        """One forward: request i computes the last ``num_sched[i]`` of the first ``seq_lens[i]``
        tokens of ``token_ids[rows[i]]`` (KV slots from ``block_table[rows[i]]``); with
        ``last_token`` (device int64, one per request, every ``num_sched`` 1) its input ids come
        from there instead. Returns the argmax after each request's last token (device int64)."""
        ...


class _DraftState:
    """The draft's block pool and per-request rows.

    Invariant: ``free_blocks`` and the rows' ``block_table[row, :num_blocks[row]]`` partition
    ``range(num_blocks)``; the draft's KV at positions ``0 .. num_held[row] - 1`` of a row was
    computed from ``token_ids[row, :num_held[row]]``; ``row_of`` and ``free_rows`` partition the
    rows. Cost: O(max_rows * max_len) int64 host memory; O(blocks touched) per step.
    """

    def __init__(self, max_rows: int, max_len: int, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.num_blocks_total = num_blocks
        max_blocks = -(-max_len // block_size)
        self.token_ids = np.zeros((max_rows, max_len), dtype=np.int64)
        self.num_held = np.zeros(max_rows, dtype=np.int64)
        self.block_table = np.zeros((max_rows, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_rows, dtype=np.int64)
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_rows - 1, -1, -1))

    def row(self, req_id: str) -> int | None:
        """The request's row (a fresh one, holding nothing, the first time); None when none is free."""
        row = self.row_of.get(req_id)
        if row is None and self.free_rows:
            row = self.row_of[req_id] = self.free_rows.pop()
            self.num_held[row] = self.num_blocks[row] = 0
        return row

    def valid_prefix(self, row: int, token_ids: np.ndarray) -> int:
        """How many leading positions of the row's KV still match ``token_ids``."""
        n = min(int(self.num_held[row]), len(token_ids))
        mismatch = np.flatnonzero(self.token_ids[row, :n] != token_ids[:n])
        return int(mismatch[0]) if len(mismatch) else n

    def reserve(self, row: int, num_positions: int) -> list[int] | None:
        """Blocks for positions ``0 .. num_positions - 1``: the new ones, or None (nothing taken)
        when the pool is short."""
        have = int(self.num_blocks[row])
        need = -(-num_positions // self.block_size) - have
        if need > len(self.free_blocks):
            return None
        new = [self.free_blocks.pop() for _ in range(max(need, 0))]
        self.block_table[row, have : have + len(new)] = new
        self.num_blocks[row] = have + len(new)
        return new

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.free_blocks.extend(self.block_table[row, : self.num_blocks[row]][::-1].tolist())
            self.num_blocks[row] = self.num_held[row] = 0
            self.free_rows.append(row)


class DraftModelProposer:
    """Drafts with a model bound to its own KV cache (see the module doc). Cost per step: one
    catch-up forward, k - 1 single-token forwards of the batch, one device->host copy of the
    drafts; host work O(batch + new tokens) numpy plus O(tokens) per request to find where its
    draft KV stops matching."""

    def __init__(self, runner: DraftSteps, device: torch.device, num_speculative_tokens: int, block_size: int,
                 num_blocks: int, max_num_reqs: int, max_model_len: int) -> None:
        self.runner = runner
        self.device = device
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.state = _DraftState(max_num_reqs, max_model_len, block_size, num_blocks)

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.state.remove(req_id)

    @torch.inference_mode()
    def propose(self, requests: list[ProposeInput]) -> dict[str, list[int]]:
        batch = self._admit(requests)
        if batch is None:
            return {}
        req_ids, rows, starts, lens, ks = batch
        drafts = torch.empty((len(rows), self.k), dtype=torch.int64, device=self.device)
        drafts[:, 0] = self._catch_up(rows, starts, lens)
        for j in range(1, self.k):
            live = np.flatnonzero(ks > j)  # all of them unless a request is near max_model_len
            if not len(live):
                break
            every = len(live) == len(rows)
            index = None if every else torch.from_numpy(live).to(self.device)
            prev = drafts[:, j - 1] if every else drafts[index, j - 1]
            # Draft j's input is draft j - 1, at position lens + j - 1.
            out = self.runner.run(self.state.token_ids, self.state.block_table, rows[live], np.ones(len(live), np.int64),
                                  lens[live] + j, last_token=prev)
            if every:
                drafts[:, j] = out
            else:
                drafts[index, j] = out
        host = drafts.cpu().numpy()
        out = {}
        for i, (req_id, row) in enumerate(zip(req_ids, rows.tolist())):
            n, k = int(lens[i]), int(ks[i])
            self.state.token_ids[row, n : n + k - 1] = host[i, : k - 1]  # the last draft is never an input
            self.state.num_held[row] = n + k - 1
            out[req_id] = host[i, :k].tolist()
        return out

    def _admit(self, requests: list[ProposeInput]):
        """Rows, blocks and catch-up start of each request that can be drafted for:
        ``(req_ids, rows, starts, lens, ks)`` (numpy int64 arrays but req_ids), or None."""
        state, admitted = self.state, []
        for r in requests:
            num_tokens = len(r.token_ids)
            k = min(self.k, self.max_model_len - num_tokens)
            row = state.row(r.req_id) if k > 0 else None
            if row is None:
                continue
            # KV for the known tokens and all drafts but the last (which is never an input).
            new_blocks = state.reserve(row, num_tokens + k - 1)
            if new_blocks is None:
                continue
            if new_blocks:
                self.runner.set_blocks(row, int(state.num_blocks[row]) - len(new_blocks), new_blocks)
            start = min(state.valid_prefix(row, r.token_ids), num_tokens - 1)
            state.token_ids[row, start:num_tokens] = r.token_ids[start:]
            state.num_held[row] = start  # until this step's forwards have run
            admitted.append((r.req_id, row, start, num_tokens, k))
        if not admitted:
            return None
        req_ids, *cols = zip(*admitted)
        return (list(req_ids), *(np.asarray(c, dtype=np.int64) for c in cols))

    def _catch_up(self, rows: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> torch.Tensor:
        """Forward each request's tokens ``starts .. lens - 1`` (in as many forwards as the runner's
        token budget needs: a new request brings its whole prompt); returns the argmax after each
        request's last token (device int64 [len(rows)])."""
        done, budget = starts.copy(), self.runner.max_num_tokens
        first = None
        while True:
            todo = np.flatnonzero(done < lens)
            if not len(todo):
                return first
            remaining = lens[todo] - done[todo]
            take = np.clip(budget - (np.cumsum(remaining) - remaining), 0, remaining)
            todo, take = todo[take > 0], take[take > 0]
            argmax = self.runner.run(self.state.token_ids, self.state.block_table, rows[todo], take, done[todo] + take)
            done[todo] += take
            if first is None and len(todo) == len(rows) and (done == lens).all():
                return argmax  # the usual case: everything in one forward
            if first is None:
                first = torch.empty(len(rows), dtype=torch.int64, device=self.device)
            finished = done[todo] == lens[todo]
            first[torch.from_numpy(todo[finished]).to(self.device)] = argmax[torch.from_numpy(finished).to(self.device)]
