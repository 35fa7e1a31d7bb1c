"""DeviceInputs: persistent host staging buffers and their device twin for one step's inputs.

Nothing is allocated per step. A step's flat inputs (token ids, positions, slots, query starts,
sequence lengths, ...) are packed into one pinned host buffer at offsets that depend only on the
step's (padded) token and request counts (``step_layout``), and reach the device in ONE
non-blocking copy into one device buffer, whose views the step then uses. On CUDA a decode-sized
step's copy is a kernel that reads the pinned buffer itself (``pagedllm/zero_copy.py``: no
copy-engine handoffs on the GPU's timeline). A CUDA graph for batch size ``bs`` captures the views
of ``step_layout(bs, bs)``, so a replay finds its inputs where a step of that size copies them.
(One copy instead of one per field: each small H2D copy costs copy-engine time plus a gap on the
GPU's timeline, together a few percent of a batch-1 decode step.)

The block table lives on the device, indexed by InputBatch row, and is updated incrementally: a
step sends only the (row, column, block id) triples of blocks added since the last step, then
gathers the scheduled rows on the device.

The host side is double-buffered (``begin_step`` flips sets): with async scheduling the CPU
prepares step N+1 while step N's copy may still be queued behind step N-1 on the GPU, so it
writes the set that step N-1 used. That copy is usually long done (the engine waits for step
N-1's sampled tokens before preparing step N+1), but a step that samples nothing (a prefill chunk)
gives the engine nothing to wait for, so each set's copy records an event and ``begin_step`` waits
on it before handing the set out again. The device buffer is single: a step's copy is queued
behind the previous step's kernels on the same stream.

Invariant: for every live InputBatch row, ``block_table[row, :n]`` on the device equals the
host InputBatch's ``block_table[row, :n]`` once ``flush_block_updates`` has run for the step.
Cost per step: one H2D copy (or zero-copy kernel) of O(tokens + requests) bytes, plus one of the
new blocks' triples when a request gained blocks.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from pagedllm import zero_copy

# From this many requests in a step, the attention kernels are given the longest-first launch order
# (CommonAttentionInputs.longest_first) when their backend takes one: with thousands of decode programs of ragged length it removes
# the tail in which a few long requests run on otherwise idle SMs. Below it the batch is one wave
# (or split-KV already evens the work) and the host-side sort and copy would only add latency.
LONGEST_FIRST_FROM = 32


def stage_longest_first(order: np.ndarray, seq_lens: np.ndarray) -> None:
    """``order[:n] = `` indices of ``seq_lens`` (length n) by decreasing length (stable)."""
    order[: len(seq_lens)] = np.argsort(-seq_lens, kind="stable")


_FLAT_FIELDS = {
    # name: (dtype, size key)
    "input_ids": (torch.int64, "tokens"),
    "positions": (torch.int64, "tokens"),
    "slot_mapping": (torch.int64, "tokens"),
    "query_start_loc": (torch.int32, "reqs+1"),
    "seq_lens": (torch.int32, "reqs"),
    # Requests longest first (CommonAttentionInputs.longest_first), staged from LONGEST_FIRST_FROM requests.
    "decode_order": (torch.int32, "reqs"),
    "rows": (torch.int64, "reqs"),
    "logits_indices": (torch.int64, "reqs"),
    # Async scheduling: token index in this step <- index into the previous step's sampled ids.
    "pending_dst": (torch.int64, "reqs"),
    "pending_src": (torch.int64, "reqs"),
}
# Every field starts at a multiple of this many bytes (Triton specialises kernels on 16-byte
# pointer alignment; a field at another offset would compile another variant mid-serving).
_ALIGN = 256
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


@functools.lru_cache(maxsize=512)
def step_layout(num_tokens: int, num_reqs: int) -> tuple[dict[str, tuple[int, int, torch.dtype]], int]:
    """``({field: (byte offset, length, dtype)}, total bytes)`` of a step of this many tokens and
    requests: the fields packed in ``_FLAT_FIELDS`` order, each ``_ALIGN``-aligned."""
    lengths = {"tokens": num_tokens, "reqs": num_reqs, "reqs+1": num_reqs + 1}
    fields, offset = {}, 0
    for name, (dtype, key) in _FLAT_FIELDS.items():
        fields[name] = (offset, lengths[key], dtype)
        offset += -(-lengths[key] * dtype.itemsize // _ALIGN) * _ALIGN
    return fields, offset


class DeviceInputs:
    """The staging buffers and device buffer of the module doc, plus the device block table.

    Invariant and cost: see the module doc (one copy per step, nothing allocated per step).
    """

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks_per_req: int, device: torch.device) -> None:
        self.device = device
        self.max_tokens, self.max_reqs = max_tokens, max_reqs
        self._on_cuda = device.type == "cuda"
        capacity = step_layout(max_tokens, max_reqs)[1]
        num_sets = 2 if self._on_cuda else 1
        self._host_bufs = [torch.zeros(capacity, dtype=torch.uint8, pin_memory=self._on_cuda) for _ in range(num_sets)]
        self._host_np = [buf.numpy() for buf in self._host_bufs]
        self._dev_buf = torch.zeros(capacity, dtype=torch.uint8, device=device) if self._on_cuda else None
        # Decode-sized steps reach the device through a kernel reading the pinned set (zero_copy.py);
        # every layout size is a multiple of _ALIGN bytes, so whole int64 words.
        self._zero_copy = zero_copy.available(device)
        self._host_words = [buf.view(torch.int64) for buf in self._host_bufs]
        self._dev_words = self._dev_buf.view(torch.int64) if self._on_cuda else None
        self._view_cache: dict[tuple, dict] = {}  # see _views
        # Step shapes besides decode ones (tokens == requests) whose views are cached: verify graphs'.
        self.recurring_shapes: set[tuple[int, int]] = set()
        self._set = 0
        self._set_read: list = [None] * num_sets  # per host set: CUDA event after its last copy
        self._step_bytes = 0
        self._step_shape = (0, 0)
        self.np: dict[str, np.ndarray] = {}  # this step's staging views (set by begin_step)
        # Block table by InputBatch row (persistent), and the per-step gathered copy (batch order).
        self.row_block_table = torch.zeros((max_reqs, max_blocks_per_req), dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_reqs, max_blocks_per_req), dtype=torch.int32, device=device)
        self._pending: list[tuple[int, int, list[int]]] = []  # (row, first column, block ids)
        # Flat (3 * capacity): a step's [3, n] triples are a contiguous prefix, so the copy reads the
        # pinned buffer directly (a strided slice would be staged through pageable memory first,
        # and a pageable copy waits for the GPU to drain).
        self._upd_hosts = [torch.zeros(3 * max_reqs * max_blocks_per_req, dtype=torch.int64, pin_memory=self._on_cuda)
                           for _ in range(num_sets)]

    def begin_step(self, num_tokens: int, num_reqs: int) -> dict[str, np.ndarray]:
        """Switch to the other host staging set (see the module docstring) and return its views for
        a step of ``num_tokens`` tokens and ``num_reqs`` requests (after padding), also kept as
        ``self.np``. Each view has exactly the field's length; its contents are stale until written."""
        if num_tokens > self.max_tokens or num_reqs > self.max_reqs:
            raise ValueError(f"step of {num_tokens} tokens / {num_reqs} requests exceeds the input buffers "
                             f"({self.max_tokens} / {self.max_reqs})")
        self._set = (self._set + 1) % len(self._host_bufs)
        if self._set_read[self._set] is not None:  # the GPU must have read this set's last contents
            self._set_read[self._set].synchronize()
        self._step_bytes = step_layout(num_tokens, num_reqs)[1]
        self._step_shape = (num_tokens, num_reqs)
        self.np = self._views(self._set, self._host_np[self._set], num_tokens, num_reqs)
        return self.np

    def copy_to_device(self) -> dict[str, torch.Tensor]:
        """Send the staged step to the device in one non-blocking copy; return the device views (on
        the CPU: the staging views themselves, as tensors)."""
        if not self._on_cuda:
            return {name: torch.from_numpy(a) for name, a in self.np.items()}
        n = self._step_bytes
        if self._zero_copy and n <= zero_copy.MAX_FETCH_BYTES:  # a kernel reads the pinned set itself
            zero_copy.copy_words(self._host_words[self._set][: n // 8], self._dev_words[: n // 8])
        else:
            self._dev_buf[:n].copy_(self._host_bufs[self._set][:n], non_blocking=True)
        # Also behind this step's block-table update copy (flushed before this call).
        event = self._set_read[self._set] = self._set_read[self._set] or torch.cuda.Event()
        event.record()
        return self.device_views(*self._step_shape)

    def device_views(self, num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        """The device views of a step of this shape (what its copy fills; a graph captures these)."""
        return self._views("device", self._dev_buf, num_tokens, num_reqs)

    def _views(self, buf_key, buf, num_tokens: int, num_reqs: int) -> dict:
        """``buf``'s fields for ``step_layout(num_tokens, num_reqs)``: numpy views of a host set,
        or tensor views of the device buffer. Cached for decode shapes (tokens == requests: a graph
        replay's shape recurs every step; prefill shapes rarely do) and ``recurring_shapes``."""
        key = (buf_key, num_tokens, num_reqs)
        views = self._view_cache.get(key)
        if views is None:
            fields, _ = step_layout(num_tokens, num_reqs)
            numpy = isinstance(buf, np.ndarray)
            views = {name: buf[off : off + n * dtype.itemsize].view(_NUMPY[dtype] if numpy else dtype)
                     for name, (off, n, dtype) in fields.items()}
            if num_tokens == num_reqs or (num_tokens, num_reqs) in self.recurring_shapes:
                self._view_cache[key] = views
        return views

    def queue_block_update(self, row: int, first_col: int, block_ids: list[int]) -> None:
        if block_ids:
            self._pending.append((row, first_col, block_ids))

    def flush_block_updates(self) -> None:
        """Scatter the queued (row, column, block id) triples into the device block table. Call it
        before the step's ``copy_to_device``, whose event then also covers this copy."""
        if not self._pending:
            return
        rows, cols, ids = [], [], []
        for row, col, blocks in self._pending:
            rows.extend([row] * len(blocks))
            cols.extend(range(col, col + len(blocks)))
            ids.extend(blocks)
        self._pending.clear()
        n = len(ids)
        if 3 * n > self._upd_hosts[self._set].shape[0]:  # a resume of many long requests at once: grow once
            self._upd_hosts[self._set] = torch.zeros(3 * n, dtype=torch.int64, pin_memory=self._on_cuda)
        upd = self._upd_hosts[self._set][: 3 * n].view(3, n)
        upd.numpy()[:] = (rows, cols, ids)
        upd_dev = upd.to(self.device, non_blocking=True)
        self.row_block_table[upd_dev[0], upd_dev[1]] = upd_dev[2].to(torch.int32)

    def gather_block_tables(self, rows_dev: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Batch-order block tables: ``block_tables[i] = row_block_table[rows[i]]``, in place."""
        out = self.block_tables[:num_rows]
        torch.index_select(self.row_block_table, 0, rows_dev[:num_rows], out=out)
        return out

