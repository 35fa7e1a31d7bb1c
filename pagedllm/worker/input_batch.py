"""InputBatch: persistent per-request rows the runner keeps between steps (vLLM's "send diffs").

Each live request owns one row of fixed-size numpy arrays: its token ids, how many are known,
and its block table. A step only writes what changed (new requests, new blocks, sampled tokens)
and then gathers the scheduled rows with vectorised numpy indexing, so preparing a step costs
O(scheduled tokens + scheduled requests * blocks per request) in C, not Python loops.

Invariant: ``req_id_to_row`` and ``free_rows`` partition ``range(max_num_reqs)``; for a live row
``token_ids[row, :num_tokens[row]]`` is prompt + outputs and ``block_table[row, :num_blocks[row]]``
its blocks in order.
"""

from __future__ import annotations

import numpy as np

from pagedllm.core.sched_output import NewRequestData
from pagedllm.sampling_params import SamplingParams


class InputBatch:
    """The rows of the module doc. Cost: O(max_num_reqs * max_model_len) int64 host memory."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Tokens sampled by launched steps whose results are not applied yet (async scheduling); a
        # step verifying drafts counts one (the sync policy waits for it before the row is read).
        self.num_pending = np.zeros(max_num_reqs, dtype=np.int64)
        # Bumped on every add: a late result for a row that was freed and reused is recognised.
        self.generation = np.zeros(max_num_reqs, dtype=np.int64)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        # The LoRA adapter id each row runs (0: the base model).
        self.lora_int_id = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_id_to_row: dict[str, int] = {}
        self.free_rows: list[int] = list(range(max_num_reqs - 1, -1, -1))

    def add(self, new: NewRequestData) -> int:
        if new.req_id in self.req_id_to_row:
            self.remove(new.req_id)
        row = self.free_rows.pop()
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.block_table[row, : len(new.block_ids)] = new.block_ids
        self.num_blocks[row] = len(new.block_ids)
        self.params[row] = new.sampling_params
        self.lora_int_id[row] = new.lora_request.lora_int_id if new.lora_request is not None else 0
        self.num_pending[row] = 0
        self.generation[row] += 1
        self.req_id_to_row[new.req_id] = row
        return row

    def remove(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is not None:
            self.params[row] = None
            self.free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            n = self.num_blocks[row]
            self.block_table[row, n : n + len(block_ids)] = block_ids
            self.num_blocks[row] = n + len(block_ids)

    def replace_tokens(self, row: int, start: int, token_ids: list[int]) -> None:
        """The row's tokens from ``start`` on become ``token_ids`` (structured output jump-forward:
        the engine appended them without sampling). A token still in flight for the row was
        sampled at ``start`` and is superseded: the generation bump makes its step's late result
        skip the row, as it does for a reused row."""
        end = start + len(token_ids)
        self.token_ids[row, start:end] = token_ids
        self.num_tokens[row] = end
        self.num_pending[row] = 0
        self.generation[row] += 1

    def append_token(self, row: int, token_id: int) -> None:
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1
