"""TokenHistory: the token ids behind each sampling row, as the runner already holds them.

Penalties, bad words and min_tokens need each row's past tokens. The runner keeps them in one
persistent host array (prompt then outputs, per request row), so the history is only a view of
that array plus per-row lengths: nothing is copied until a logits processor asks for some rows.

Invariant: for sampling row i, ``token_ids[rows[i], :num_tokens[i]]`` is its prompt (the first
``num_prompt_tokens[i]`` ids) followed by its outputs so far; entries past ``num_tokens[i]`` are
stale and never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TokenHistory:
    token_ids: np.ndarray  # int64 [R, L], any R > max(rows); shared with the runner, read only
    rows: np.ndarray  # int64 [B]: sampling row i lives in token_ids[rows[i]]
    num_prompt_tokens: np.ndarray  # int64 [B]
    num_tokens: np.ndarray  # int64 [B]: prompt + outputs so far

    @classmethod
    def from_lists(cls, prompts: list[list[int]], outputs: list[list[int]]) -> TokenHistory:
        """Build a history from Python lists (tests, tools). Cost O(B * max length)."""
        seqs = [list(p) + list(o) for p, o in zip(prompts, outputs)]
        width = max((len(s) for s in seqs), default=0) or 1
        ids = np.zeros((len(seqs), width), dtype=np.int64)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
        return cls(
            token_ids=ids,
            rows=np.arange(len(seqs), dtype=np.int64),
            num_prompt_tokens=np.array([len(p) for p in prompts], dtype=np.int64),
            num_tokens=np.array([len(s) for s in seqs], dtype=np.int64),
        )

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def output_positions(self) -> np.ndarray:
        """Index of the token each row is about to produce (its number of outputs so far)."""
        return self.num_tokens - self.num_prompt_tokens

    def output_tail(self, i: int, n: int) -> list[int]:
        """The last ``min(n, outputs so far)`` output tokens of row i. Cost O(n)."""
        end = int(self.num_tokens[i])
        start = max(int(self.num_prompt_tokens[i]), end - n)
        return self.token_ids[self.rows[i], start:end].tolist()

    def window(self, sel: np.ndarray, with_prompt: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows ``sel``'s tokens over one shared window of positions: (ids, is_output, valid), each
        [len(sel), W]. ``valid`` marks the row's real tokens (prompt ones only ``with_prompt``);
        other entries of ``ids`` are stale. Cost O(len(sel) * W), W = the longest selected
        sequence (or the longest output part when ``with_prompt`` is False)."""
        n_prompt = self.num_prompt_tokens[sel][:, None]
        n_tokens = self.num_tokens[sel][:, None]
        lo = 0 if with_prompt else int(n_prompt.min(initial=0))
        hi = max(int(n_tokens.max(initial=0)), lo)
        ids = self.token_ids[self.rows[sel], lo:hi]
        pos = np.arange(lo, lo + ids.shape[1], dtype=np.int64)[None, :]
        is_output = (pos >= n_prompt) & (pos < n_tokens)
        valid = pos < n_tokens if with_prompt else is_output
        return ids, is_output, valid
