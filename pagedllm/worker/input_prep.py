"""InputPreparer: one scheduled step -> flat device inputs, attention metadata and logits rows.

The scheduled rows of the InputBatch are gathered with vectorised numpy into DeviceInputs' staging
buffers (token ids, positions, slots, query starts, sequence lengths), a pure decode step is padded
to a captured CUDA-graph size, everything reaches the device in one copy, and the attention
backend's builder makes the step's metadata from it, once.

Tokens of one step feed the next without a host round trip: a token the previous step sampled and
the host has not seen yet (``InputBatch.num_pending``) is copied on the device from that step's
sampled ids into this step's input ids (``_stage_pending_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata, CommonAttentionInputs
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.worker.cuda_graph import CUDAGraphRunner
from pagedllm.worker.device_inputs import LONGEST_FIRST_FROM, DeviceInputs, stage_longest_first
from pagedllm.worker.input_batch import InputBatch


@dataclass
class PreparedInputs:
    """One step's device inputs and where its logits rows come from."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    # Token index of each logits row (a slice when they are 0..n-1).
    logits_indices: torch.Tensor | slice
    req_ids: list[str]  # scheduled requests in batch order
    sample_req_idx: list[int]  # indices into req_ids of the requests that produce tokens
    query_start_loc: np.ndarray  # host [num_reqs + 1] (staging view, valid for this step)
    seq_lens: np.ndarray  # host [num_reqs]
    graph_size: int | None = None  # padded batch size of the graph to replay, None = eager
    graph_query_len: int = 1  # queries per request of that graph (1: decode, 1 + k: verify)
    # Per sampled request, the drafts it verifies (it has len + 1 logits rows); None: no drafts.
    drafts: list[list[int]] | None = None


class InputPreparer:
    """Prepares every step's inputs for one runner.

    Invariant: ``last_sampled`` holds the device ids the last launched step sampled and
    ``last_sample_index[row]`` the index of a row's id there (-1: that row's token may not be
    forwarded on the device; the host must know it first). Cost per step: O(scheduled tokens +
    scheduled requests) numpy work and one host->device copy; Python loops only over the requests
    with drafts.
    """

    def __init__(self, batch: InputBatch, backend: AttentionBackend, device: torch.device, block_size: int,
                 max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int) -> None:
        self.batch = batch
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.inputs = DeviceInputs(max_num_tokens, max_num_reqs, max_blocks_per_req, device)
        self._longest_first = device.type == "cuda" and backend.uses_longest_first_order
        self.last_sampled: torch.Tensor | None = None
        self.last_sample_index = np.full(max_num_reqs, -1, dtype=np.int64)
        self._drafts_by_row = np.zeros(max_num_reqs, dtype=np.int64)  # scratch of _place_drafts

    def sampled(self, token_ids: torch.Tensor, rows: np.ndarray | list[int], index: np.ndarray) -> None:
        """A step was launched that sampled ``token_ids``; ``rows[i]``'s token is ``token_ids[index[i]]``
        and may be forwarded to the next step (every other row's may not)."""
        self.last_sampled = token_ids
        self.last_sample_index[:] = -1
        self.last_sample_index[rows] = index

    def prepare(self, so: SchedulerOutput, rows: np.ndarray, graph_runner: CUDAGraphRunner | None) -> PreparedInputs:
        """Gather the scheduled rows into flat inputs (vectorised numpy into the staging buffers),
        pad a pure-decode batch (or, with speculation, a batch of short queries) to a captured graph
        shape, and copy everything to the device."""
        batch = self.batch
        req_ids = list(so.num_scheduled_tokens.keys())
        num_reqs = len(req_ids)
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
        total = int(num_sched.sum())
        max_query_len = int(num_sched.max())
        start = batch.num_computed_tokens[rows]
        seq_lens = start + num_sched
        graph_size, graph_q = graph_shape(graph_runner, num_reqs, max_query_len, seq_lens)
        if graph_size is None:
            stage = self.inputs.begin_step(total, num_reqs)
        else:
            stage = self.inputs.begin_step(graph_size * graph_q, graph_size)
        drafts = so.scheduled_spec_decode_tokens
        if drafts:  # their ids are read by the gather below
            num_drafts = self._place_drafts(drafts, rows)
        first_token = stage_tokens(stage, batch.token_ids, batch.block_table, self.block_size, rows, num_sched,
                                   seq_lens, graph_size, graph_q)
        ends = first_token + num_sched  # one past each request's last token in the staged layout
        known = batch.num_tokens[rows]
        last = known + batch.num_pending[rows]  # a request samples when its step reaches this
        if drafts:
            last += num_drafts
        sample_idx = np.nonzero(seq_lens == last)[0]
        num_pending_copies, pending_in_order = self._stage_pending_tokens(rows, start, seq_lens, known, first_token)
        stage["logits_indices"][: len(sample_idx)] = ends[sample_idx] - 1
        # After this step these tokens are computed (the scheduler sends the authoritative value).
        batch.num_computed_tokens[rows] = seq_lens
        n_tok, n_req = (total, num_reqs) if graph_size is None else (graph_size * graph_q, graph_size)
        inp = self._to_device_inputs(req_ids, sample_idx, n_tok, n_req, total, max_query_len, graph_size,
                                     num_pending_copies, pending_in_order)
        inp.graph_query_len = graph_q
        if drafts:
            self._logits_at_drafts(inp, drafts, num_drafts[sample_idx], ends[sample_idx])
        return inp

    def _place_drafts(self, drafts: dict[str, list[int]], rows: np.ndarray) -> np.ndarray:
        """Write each request's drafts after its known tokens (where the gather reads its inputs;
        past ``num_tokens`` a row's ids are scratch) and return the draft count per scheduled row."""
        batch, by_row = self.batch, self._drafts_by_row
        for req_id, tokens in drafts.items():
            row = batch.req_id_to_row[req_id]
            n = int(batch.num_tokens[row])
            batch.token_ids[row, n : n + len(tokens)] = tokens
            by_row[row] = len(tokens)
        num_drafts = by_row[rows]
        by_row[rows] = 0
        return num_drafts

    def _logits_at_drafts(self, inp: PreparedInputs, drafts: dict[str, list[int]], num_drafts: np.ndarray,
                          ends: np.ndarray) -> None:
        """A step with drafts takes logits at each drafted request's last 1 + d positions."""
        counts = num_drafts + 1
        first = np.cumsum(counts) - counts
        idx = np.repeat(ends - counts, counts) + np.arange(int(counts.sum())) - np.repeat(first, counts)
        inp.logits_indices = torch.from_numpy(idx).to(self.device, non_blocking=True)
        inp.drafts = [drafts.get(inp.req_ids[i], []) for i in inp.sample_req_idx]

    def _stage_pending_tokens(self, rows, start, seq_lens, known, first_token) -> tuple[int, bool]:
        """Rows whose next input token was sampled by the step still in flight: stage (index in
        this step's input_ids, index in the previous step's sampled ids) pairs for a device copy.
        Returns how many, and whether they are the plain copy of ids 0..n-1 to tokens 0..n-1."""
        pending = np.nonzero((self.batch.num_pending[rows] > 0) & (known >= start) & (known < seq_lens))[0]
        if not len(pending):
            return 0, False
        stage = self.inputs.np
        dst = stage["pending_dst"][: len(pending)]
        src = stage["pending_src"][: len(pending)]
        dst[:] = first_token[pending] + known[pending] - start[pending]
        src[:] = self.last_sample_index[rows[pending]]
        # Steady decode: token i of this step is sampled id i of the last one (one plain copy).
        order = np.arange(len(pending))
        return len(pending), bool(np.array_equal(dst, order) and np.array_equal(src, order))

    def _to_device_inputs(self, req_ids, sample_idx, n_tok, n_req, total, max_query_len, graph_size,
                          num_pending_copies: int, pending_in_order: bool) -> PreparedInputs:
        stage = self.inputs.np
        use_order = self._longest_first and n_req >= LONGEST_FIRST_FROM
        if use_order:
            stage_longest_first(stage["decode_order"], stage["seq_lens"][:n_req])
        self.inputs.flush_block_updates()
        dev = self.inputs.copy_to_device()  # every staged field, in one copy
        meta = self.backend.metadata_builder.build(CommonAttentionInputs(
            num_actual_tokens=n_tok if graph_size is not None else total,
            max_query_len=max_query_len,
            query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"],
            block_tables=self.inputs.gather_block_tables(dev["rows"], n_req),
            slot_mapping=dev["slot_mapping"],
            query_start_loc_host=stage["query_start_loc"],
            seq_lens_host=stage["seq_lens"],
            longest_first=dev["decode_order"] if use_order else None,
        ))
        input_ids = dev["input_ids"]
        if num_pending_copies:
            n = num_pending_copies
            if pending_in_order:
                input_ids[:n].copy_(self.last_sampled[:n])
            else:
                input_ids.index_copy_(0, dev["pending_dst"][:n], self.last_sampled[dev["pending_src"][:n]])
        num_logits = len(sample_idx)
        leading = stage["logits_indices"][:num_logits]
        return PreparedInputs(
            input_ids=input_ids,
            positions=dev["positions"],
            attn_metadata=meta,
            # Pure decode samples tokens 0..n-1 in order: a slice of the hidden states, no gather.
            logits_indices=(slice(0, num_logits) if np.array_equal(leading, np.arange(num_logits))
                            else dev["logits_indices"][:num_logits]),
            req_ids=req_ids,
            sample_req_idx=sample_idx.tolist(),
            query_start_loc=stage["query_start_loc"],
            seq_lens=stage["seq_lens"],
            graph_size=graph_size,
        )


def graph_shape(graph_runner: CUDAGraphRunner | None, num_reqs: int, max_query_len: int,
                 seq_lens: np.ndarray) -> tuple[int | None, int]:
    """``(padded batch size, query length)`` of the captured graph a step replays, or ``(None, 1)``
    for an eager step: a pure decode step pads to a decode graph; with speculation, a step whose
    queries are all at most ``verify_query_len`` long (verification: one token plus up to k
    drafts per request) pads to a verify graph, when every request has at least that many tokens
    of context (its padded queries then start at a position >= 0)."""
    if graph_runner is None:
        return None, 1
    if max_query_len == 1:
        if num_reqs > graph_runner.max_size:
            return None, 1
        return graph_runner.padded_size(num_reqs), 1
    q = graph_runner.verify_query_len
    if max_query_len > q or num_reqs > graph_runner.max_verify_size or int(seq_lens.min()) < q:
        return None, 1
    return graph_runner.padded_size(num_reqs, q), q


def stage_tokens(stage: dict[str, np.ndarray], token_ids: np.ndarray, block_table: np.ndarray, block_size: int,
                 rows: np.ndarray, num_sched: np.ndarray, seq_lens: np.ndarray, graph_size: int | None,
                 graph_q: int) -> np.ndarray:
    """Stage a step's token ids, positions, KV slots, query starts, sequence lengths and rows in the
    layout of its shape (``graph_shape``): back to back (eager), back to back then padded to
    ``graph_size`` (decode graph), or uniform (verify graph). Request i computes the last
    ``num_sched[i]`` of the first ``seq_lens[i]`` tokens of ``token_ids[rows[i]]``. Returns the
    staged index of each request's first token."""
    if graph_q > 1:
        return stage_uniform_batch(stage, token_ids, block_table, block_size, rows, num_sched, seq_lens, graph_q,
                                   graph_size)
    num_reqs = len(rows)
    qsl = stage["query_start_loc"]
    qsl[0] = 0
    np.cumsum(num_sched, out=qsl[1 : num_reqs + 1])
    first_token = qsl[:num_reqs]
    total = int(qsl[num_reqs])
    stage_flat_tokens(stage, token_ids, block_table, block_size, rows, num_sched, seq_lens - num_sched, first_token,
                      total)
    stage["seq_lens"][:num_reqs] = seq_lens
    stage["rows"][:num_reqs] = rows
    if graph_size is not None:
        pad_decode_batch(stage, total, num_reqs, graph_size)
    return first_token


def stage_flat_tokens(stage: dict[str, np.ndarray], token_ids: np.ndarray, block_table: np.ndarray, block_size: int,
                      rows: np.ndarray, num_sched: np.ndarray, start: np.ndarray, first_token: np.ndarray,
                      total: int) -> None:
    """Stage the token ids, positions and KV slots of each request's ``num_sched[i]`` tokens from
    position ``start[i]`` (of ``rows[i]``), back to back from ``first_token[i]``. Cost: O(total) numpy."""
    tok_row = np.repeat(rows, num_sched)  # flat per-token indices: which row, which position
    positions = np.arange(total, dtype=np.int64) - np.repeat(first_token - start, num_sched)
    stage["positions"][:total] = positions
    stage["input_ids"][:total] = token_ids[tok_row, positions]
    stage["slot_mapping"][:total] = block_table[tok_row, positions // block_size] * block_size + positions % block_size


def pad_decode_batch(stage: dict[str, np.ndarray], num_tokens: int, num_reqs: int, size: int) -> None:
    """Pad a staged decode batch (one token per request) to ``size`` requests: token 0 at position 0,
    slot -1 (no KV write), empty context (the decode kernel writes a zero row)."""
    stage["input_ids"][num_tokens:size] = 0
    stage["positions"][num_tokens:size] = 0
    stage["slot_mapping"][num_tokens:size] = -1
    stage["seq_lens"][num_reqs:size] = 0
    stage["rows"][num_reqs:size] = 0
    stage["query_start_loc"][num_reqs + 1 : size + 1] = np.arange(num_tokens + 1, num_tokens + 1 + size - num_reqs)


def stage_uniform_batch(stage: dict[str, np.ndarray], token_ids: np.ndarray, block_table: np.ndarray,
                        block_size: int, rows: np.ndarray, num_sched: np.ndarray, seq_lens: np.ndarray,
                        query_len: int, size: int) -> np.ndarray:
    """Stage requests as a batch of ``size`` requests of exactly ``query_len`` queries each (the
    layout a verify CUDA graph was captured with); returns each request's first real token index.

    Request i (of ``rows[i]``) computes its last ``num_sched[i] <= query_len`` tokens of
    ``seq_lens[i] >= query_len``: they take the last ``num_sched[i]`` of its ``query_len`` staged
    queries, whose positions are ``seq_lens[i] - query_len ..  seq_lens[i] - 1``. The leading ones
    are dummies: already computed positions, recomputed with their own token ids, writing no KV
    (slot -1); causal attention keeps them out of the real queries' results, which end each
    request's group, so a request's logits rows are those of the eager layout shifted. Padding
    requests (``i >= len(rows)``) are dummies over the first ``query_len`` positions of row 0.
    Cost: O(size * query_len) numpy, no Python loop."""
    n, q = len(rows), query_len
    lens = np.full(size, q, dtype=np.int64)
    lens[:n] = seq_lens
    row_of = np.zeros(size, dtype=np.int64)
    row_of[:n] = rows
    counts = np.zeros(size, dtype=np.int64)
    counts[:n] = num_sched
    local = np.arange(q)
    positions = (lens - q)[:, None] + local  # [size, q]
    real = local >= (q - counts)[:, None]
    slots = block_table[row_of[:, None], positions // block_size] * block_size + positions % block_size
    stage["positions"][:] = positions.ravel()
    stage["input_ids"][:] = token_ids[row_of[:, None], positions].ravel()
    stage["slot_mapping"][:] = np.where(real, slots, -1).ravel()
    stage["seq_lens"][:] = lens
    stage["rows"][:] = row_of
    stage["query_start_loc"][:] = np.arange(0, (size + 1) * q, q)
    return (np.arange(n, dtype=np.int64) + 1) * q - num_sched
