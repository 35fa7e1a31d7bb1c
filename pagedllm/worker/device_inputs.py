"""DeviceInputs: persistent host staging buffers and their device twins for one step's inputs.

Nothing is allocated per step: the runner writes a step's flat inputs into the (pinned, on CUDA)
host arrays and copies the used prefix of each to the device without blocking. The block table
lives on the device, indexed by InputBatch row, and is updated incrementally: a step sends only
the (row, column, block id) triples of blocks added since the last step, then gathers the
scheduled rows on the device. CUDA graphs capture views of these same device tensors.

The host side is double-buffered (``begin_step`` flips sets): with async scheduling the CPU
prepares step N+1 while step N's copies may still be queued behind step N-1 on the GPU, so it
writes the set that step N-1 used, whose copies are known complete (the engine has waited for
step N-1's results before preparing step N+1).

Invariant: for every live InputBatch row, ``block_table[row, :n]`` on the device equals the
host InputBatch's ``block_table[row, :n]`` once ``flush_block_updates`` has run for the step.
Cost per step: a handful of small H2D copies, O(tokens + requests + new blocks) bytes.
"""

from __future__ import annotations

import numpy as np
import torch

# From this many requests in a step, the attention kernels are given the longest-first launch order
# (AttentionMetadata.decode_order): with thousands of decode programs of ragged length it removes
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
    # Requests longest first (AttentionMetadata.decode_order), staged from LONGEST_FIRST_FROM requests.
    "decode_order": (torch.int32, "reqs"),
    "rows": (torch.int64, "reqs"),
    "logits_indices": (torch.int64, "reqs"),
    # Async scheduling: token index in this step <- index into the previous step's sampled ids.
    "pending_dst": (torch.int64, "reqs"),
    "pending_src": (torch.int64, "reqs"),
}


class DeviceInputs:
    def __init__(self, max_tokens: int, max_reqs: int, max_blocks_per_req: int, device: torch.device) -> None:
        self.device = device
        pin = device.type == "cuda"
        sizes = {"tokens": max_tokens, "reqs": max_reqs, "reqs+1": max_reqs + 1}
        num_sets = 2 if pin else 1
        self._host_sets = [
            {name: torch.zeros(sizes[key], dtype=dtype, pin_memory=pin) for name, (dtype, key) in _FLAT_FIELDS.items()}
            for _ in range(num_sets)
        ]
        self._np_sets = [{name: t.numpy() for name, t in hs.items()} for hs in self._host_sets]
        self._set = 0
        self.dev: dict[str, torch.Tensor] = {
            name: (host if not pin else torch.zeros_like(host, device=device))
            for name, host in self._host_sets[0].items()
        }
        self._select_set(0)
        # Block table by InputBatch row (persistent), and the per-step gathered copy (batch order).
        self.row_block_table = torch.zeros((max_reqs, max_blocks_per_req), dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_reqs, max_blocks_per_req), dtype=torch.int32, device=device)
        self._pending: list[tuple[int, int, list[int]]] = []  # (row, first column, block ids)
        # Flat (3 * capacity): a step's [3, n] triples are a contiguous prefix, so the copy reads the
        # pinned buffer directly (a strided slice would be staged through pageable memory first,
        # and a pageable copy waits for the GPU to drain).
        self._upd_hosts = [torch.zeros(3 * max_reqs * max_blocks_per_req, dtype=torch.int64, pin_memory=pin)
                           for _ in range(num_sets)]

    def _select_set(self, index: int) -> None:
        self._set = index
        self.host = self._host_sets[index]
        self.np = self._np_sets[index]

    def begin_step(self) -> None:
        """Switch to the other host staging set (see the module docstring)."""
        self._select_set((self._set + 1) % len(self._host_sets))

    def to_device(self, name: str, n: int) -> torch.Tensor:
        """Copy the first ``n`` staged entries of ``name`` to the device; return the device view."""
        if self.device.type != "cuda":
            return self.host[name][:n]
        dev = self.dev[name][:n]
        dev.copy_(self.host[name][:n], non_blocking=True)
        return dev

    def queue_block_update(self, row: int, first_col: int, block_ids: list[int]) -> None:
        if block_ids:
            self._pending.append((row, first_col, block_ids))

    def flush_block_updates(self) -> None:
        """Scatter the queued (row, column, block id) triples into the device block table."""
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
            self._upd_hosts[self._set] = torch.zeros(3 * n, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        upd = self._upd_hosts[self._set][: 3 * n].view(3, n)
        upd.numpy()[:] = (rows, cols, ids)
        upd_dev = upd.to(self.device, non_blocking=True)
        self.row_block_table[upd_dev[0], upd_dev[1]] = upd_dev[2].to(torch.int32)

    def gather_block_tables(self, rows_dev: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Batch-order block tables: ``block_tables[i] = row_block_table[rows[i]]``, in place."""
        out = self.block_tables[:num_rows]
        torch.index_select(self.row_block_table, 0, rows_dev[:num_rows], out=out)
        return out
