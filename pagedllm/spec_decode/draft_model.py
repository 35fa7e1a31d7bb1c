"""Draft-model proposer: a second, smaller model with the target's vocabulary drafts k tokens.

The draft keeps its own paged KV cache (its own layers and head shapes) with its own block pool:
``_DraftKV`` gives each request a block table and remembers which token ids its KV holds. Each
step it first catches up with the request's accepted tokens (one eager forward over every
request's new tokens, from the first position where what it computed differs from what was
accepted: rejected drafts are simply recomputed), takes the argmax there as the first draft,
then runs k - 1 single-token decode steps over the batch for the others. Drafts are the argmax
(a point mass: see rejection_sampler.py), whatever the request's sampling parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from pagedllm.attention.backend import AttentionBackend, common_inputs_from_lists, forward_context
from pagedllm.spec_decode.interface import ProposeInput


class _DraftKV:
    """The draft's block pool and per-request state.

    Invariant: ``free`` and the lists in ``tables`` partition ``range(num_blocks)``; ``computed[r]``
    holds the token ids whose KV request r's blocks hold, positions ``0 .. len - 1``, and its blocks
    cover them. Cost: O(blocks touched) per step.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, np.ndarray] = {}

    def valid_prefix(self, req_id: str, token_ids: np.ndarray) -> int:
        """How many leading positions of the draft's KV still match ``token_ids``."""
        held = self.computed.get(req_id)
        if held is None:
            return 0
        n = min(len(held), len(token_ids))
        mismatch = np.flatnonzero(held[:n] != token_ids[:n])
        return int(mismatch[0]) if len(mismatch) else n

    def reserve(self, req_id: str, num_positions: int) -> bool:
        """Blocks for positions ``0 .. num_positions - 1``; False (nothing taken) if the pool is short."""
        table = self.tables.setdefault(req_id, [])
        need = -(-num_positions // self.block_size) - len(table)
        if need > len(self.free):
            return False
        for _ in range(max(need, 0)):
            table.append(self.free.pop())
        return True

    def slots(self, req_id: str, positions: np.ndarray) -> np.ndarray:
        table = np.asarray(self.tables[req_id], dtype=np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def remove(self, req_id: str) -> None:
        self.free.extend(reversed(self.tables.pop(req_id, [])))
        self.computed.pop(req_id, None)


class DraftModelProposer:
    """Runs ``model`` (bound to its own KV caches) over the requests' new tokens, then k - 1 more
    tokens. Cost per step: one eager forward over the new tokens plus k - 1 decode forwards of the
    batch, each with its metadata built from host lists."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, device: torch.device,
                 num_speculative_tokens: int, block_size: int, num_blocks: int, max_model_len: int) -> None:
        self.model = model
        self.backend = backend
        self.device = device
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.kv = _DraftKV(num_blocks, block_size)

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.kv.remove(req_id)

    @torch.inference_mode()
    def propose(self, requests: list[ProposeInput]) -> dict[str, list[int]]:
        batch = []  # (request, first position to compute, number of drafts)
        for r in requests:
            num_tokens = len(r.token_ids)
            k = min(self.k, self.max_model_len - num_tokens)
            # KV for the known tokens and all drafts but the last (which is never an input).
            if k <= 0 or not self.kv.reserve(r.req_id, num_tokens + k - 1):
                continue
            start = min(self.kv.valid_prefix(r.req_id, r.token_ids), num_tokens - 1)
            batch.append((r, start, k))
        if not batch:
            return {}
        tokens = self._catch_up(batch)
        drafts = [[t] for t in tokens]
        for j in range(1, max(k for _, _, k in batch)):
            live = [i for i, (_, _, k) in enumerate(batch) if k > j]
            nxt = self._decode([batch[i][0] for i in live], [drafts[i][-1] for i in live],
                               [len(batch[i][0].token_ids) + j - 1 for i in live])
            for i, t in zip(live, nxt):
                drafts[i].append(t)
        for (r, _, _), d in zip(batch, drafts):
            self.kv.computed[r.req_id] = np.concatenate([r.token_ids, np.asarray(d[:-1], dtype=np.int64)])
        return {r.req_id: d for (r, _, _), d in zip(batch, drafts)}

    def _catch_up(self, batch: list[tuple[ProposeInput, int, int]]) -> list[int]:
        """One forward over each request's tokens from its first stale position to its last known
        one; returns the argmax after each request's last token (its first draft)."""
        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for r, start, _ in batch:
            pos = np.arange(start, len(r.token_ids))
            ids.append(r.token_ids[start:])
            positions.append(pos)
            slots.append(self.kv.slots(r.req_id, pos))
            query_lens.append(len(pos))
            seq_lens.append(len(r.token_ids))
        return self._forward(batch, np.concatenate(ids), np.concatenate(positions), np.concatenate(slots),
                             query_lens, seq_lens)

    def _decode(self, requests: list[ProposeInput], token_ids: list[int], positions: list[int]) -> list[int]:
        """One token per request at ``positions`` (each request's context is everything before)."""
        pos = np.asarray(positions, dtype=np.int64)
        slots = np.concatenate([self.kv.slots(r.req_id, pos[i : i + 1]) for i, r in enumerate(requests)])
        return self._forward([(r, 0, 0) for r in requests], np.asarray(token_ids, dtype=np.int64), pos, slots,
                             [1] * len(requests), (pos + 1).tolist())

    def _forward(self, batch, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                 query_lens: list[int], seq_lens: list[int]) -> list[int]:
        tables = [self.kv.tables[r.req_id] for r, _, _ in batch]
        common = common_inputs_from_lists(query_lens, seq_lens, tables, slots.tolist(), self.device)
        meta = self.backend.metadata_builder.build(common)
        with forward_context(meta, self.backend):
            hidden = self.model(torch.from_numpy(ids).to(self.device), torch.from_numpy(positions).to(self.device))
        last = torch.from_numpy(np.cumsum(query_lens) - 1).to(self.device)
        return self.model.compute_logits(hidden[last], upcast=False).argmax(dim=-1).tolist()
