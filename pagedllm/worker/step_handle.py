"""StepHandle: one launched step's result on its way to the host; StepTrace: per-step GPU timing."""

from __future__ import annotations

import time

import numpy as np
import torch

from pagedllm.core.sched_output import ModelRunnerOutput, TokenLogprobs
from pagedllm.sample.logprobs import sampled_logprobs_rows
from pagedllm.sample.sampler import SamplerOutput
from pagedllm.spec_decode.interface import ProposeInput, Proposer
from pagedllm.spec_decode.rejection_sampler import accept_drafts
from pagedllm.worker.input_batch import InputBatch


class StepHandle:
    """One launched step: the sampled ids (and logprobs) are being copied to pinned host memory;
    ``result()`` waits on an event for them, applies them to the InputBatch once (verifying drafts
    where the step carried some), asks the proposer for the next drafts, and returns the
    ModelRunnerOutput. Rows that were freed (or freed and reused) meanwhile are skipped.

    Invariant: until ``result()`` has run, every row this step samples counts one token in
    ``batch.num_pending``. Cost of ``result()``: one event wait, then O(sampled tokens) host work
    (plus the proposer's).

    It holds the runner's InputBatch, not the runner: the runner keeps its last handle, and a
    runner <-> handle cycle would outlive the engine (the engine core freezes the garbage collector's
    view of everything built at start-up), keeping the model and the KV cache on the GPU."""

    def __init__(self, batch: InputBatch | None, req_ids: list[str], sample_req_idx: list[int],
                 proposer: Proposer | None = None) -> None:
        self.batch = batch
        self.req_ids = req_ids
        self.sample_req_idx = sample_req_idx
        self.proposer = proposer
        self.prompt_logprobs: dict = {}
        self._rows: list[int] = []
        self._gens: list[int] = []
        self._params: list = []
        # Per sampled request, the drafts this step verifies (None: no request had drafts).
        self._drafts: list[list[int]] | None = None
        self._host: SamplerOutput | None = None
        self._event = None
        self._output: ModelRunnerOutput | None = None

    @classmethod
    def empty(cls) -> StepHandle:
        handle = cls(None, [], [])
        handle._output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        return handle

    def launch_copies(self, result: SamplerOutput, rows: list[int], params: list,
                      drafts: list[list[int]] | None = None) -> None:
        """Start the copies of ``result`` (one sampled row per entry of ``rows``, or with ``drafts``
        ``len(drafts[i]) + 1`` rows for sampled request i, whose params are then per row)."""
        batch = self.batch
        self._rows, self._params, self._drafts = rows, params, drafts
        self._gens = [int(batch.generation[r]) for r in rows]
        batch.num_pending[rows] += 1
        # The fused sampler may have stored the ids in pinned memory itself (no copy to launch).
        token_ids = result.host_token_ids if result.host_token_ids is not None else _to_host(result.token_ids)
        self._host = SamplerOutput(token_ids, *(_to_host(t) for t in (result.logprob_token_ids, result.logprobs,
                                                                      result.sampled_ranks)))
        if result.token_ids.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def __del__(self) -> None:
        # A kernel may still be storing this step's ids into the pinned buffer held here: wait for
        # it before the buffer goes back to torch's host allocator (which knows nothing of that
        # kernel) to be handed out again. Handles are normally dropped after result() has waited.
        if self._output is None and self._event is not None:
            self._event.synchronize()

    def result(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        if self._event is not None:
            self._event.synchronize()
        sampled: list[list[int]] = [[] for _ in self.req_ids]
        logprobs_out = None
        if self._host is not None:
            token_ids = self._host.token_ids.tolist()
            if self._drafts is None:
                self._apply_tokens(sampled, token_ids)
            else:
                self._verify_drafts(sampled, token_ids)
            if self._host.logprobs is not None:
                logprobs_out = self._logprobs(sampled)
        drafts = self._propose() if self.proposer is not None else None
        self._output = ModelRunnerOutput(req_ids=self.req_ids, sampled_token_ids=sampled, logprobs=logprobs_out,
                                         prompt_logprobs=self.prompt_logprobs, draft_token_ids=drafts)
        return self._output

    def _apply_tokens(self, sampled: list[list[int]], token_ids: list[int]) -> None:
        """One token per sampled request (no drafts this step)."""
        batch = self.batch
        for i, row, gen, tok in zip(self.sample_req_idx, self._rows, self._gens, token_ids):
            if batch.generation[row] == gen and batch.num_pending[row] > 0:
                batch.num_pending[row] -= 1
                batch.append_token(row, tok)
            sampled[i] = [tok]

    def _verify_drafts(self, sampled: list[list[int]], token_ids: list[int]) -> None:
        """Request i sampled ``len(drafts) + 1`` tokens, one per position; the drafts are accepted
        while each equals the token sampled at its position (``accept_drafts``: exact for the
        point-mass drafts every proposer makes) and the token sampled after the last accepted
        draft is appended. The KV of rejected drafts stops counting as computed."""
        batch, first = self.batch, 0
        for i, row, gen, drafts in zip(self.sample_req_idx, self._rows, self._gens, self._drafts):
            accepted = accept_drafts(token_ids[first : first + len(drafts) + 1], drafts)
            first += len(drafts) + 1
            if batch.generation[row] == gen and batch.num_pending[row] > 0:
                batch.num_pending[row] -= 1
                for tok in accepted:
                    batch.append_token(row, tok)
                batch.num_computed_tokens[row] -= len(drafts) + 1 - len(accepted)
            sampled[i] = accepted

    def _logprobs(self, sampled: list[list[int]]) -> list[list[TokenLogprobs] | None]:
        """Per request, the logprobs of each token it got (None where it asked for none)."""
        per_row = sampled_logprobs_rows(self._host, self._params)
        out: list[list[TokenLogprobs] | None] = [None] * len(self.req_ids)
        first = 0
        for j, i in enumerate(self.sample_req_idx):
            if per_row[first] is not None:
                out[i] = per_row[first : first + len(sampled[i])]
            first += 1 if self._drafts is None else len(self._drafts[j]) + 1
        return out

    def _propose(self) -> dict[str, list[int]]:
        """Ask the proposer for drafts of every request that got tokens and is still live here."""
        batch, requests = self.batch, []
        for i, row, gen in zip(self.sample_req_idx, self._rows, self._gens):
            if batch.generation[row] == gen and batch.params[row] is not None:
                n = int(batch.num_tokens[row])
                requests.append(ProposeInput(self.req_ids[i], batch.token_ids[row, :n],
                                             int(batch.num_prompt_tokens[row])))
        if not requests:
            return {}
        drafts = self.proposer.propose(requests)
        # Never past the row's capacity (the scheduler also keeps requests under max_model_len).
        room = {r.req_id: batch.token_ids.shape[1] - 1 - len(r.token_ids) for r in requests}
        return {req_id: list(d[: max(room.get(req_id, 0), 0)]) for req_id, d in drafts.items() if d}


class StepTrace:
    """CUDA events around every launched step, for the benchmark's per-step breakdown. Recording
    an event does not wait for the GPU; ``rows()`` synchronizes once at the end. Event ``start``
    fires when the GPU reaches the step, ``end`` when it finishes the step's sampling and copies;
    the gap from one step's end to the next one's start is time the GPU sat idle.

    Invariant: one entry per traced step, in launch order. Cost: two events per step."""

    def __init__(self) -> None:
        self._steps: list = []

    def begin(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev, time.perf_counter()

    def end(self, begun, num_reqs: int, query_start_loc: np.ndarray, seq_lens: np.ndarray,
            graph_size: int | None) -> None:
        start, host_start = begun
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        query_lens = np.diff(query_start_loc)[:num_reqs]
        seq_lens = np.asarray(seq_lens[:num_reqs], dtype=np.int64)
        self._steps.append((start, ev, {
            "num_reqs": num_reqs,
            "num_tokens": int(query_lens.sum()),
            "num_decodes": int((query_lens == 1).sum()),
            "sum_seq_lens": int(seq_lens.sum()),
            "sum_decode_seq_lens": int(seq_lens[query_lens == 1].sum()),
            "graph_size": graph_size,
            "host_start_s": host_start,
            "host_launch_ms": (time.perf_counter() - host_start) * 1e3,
        }))

    def rows(self) -> list[dict]:
        torch.cuda.synchronize()
        out = []
        t0 = self._steps[0][2]["host_start_s"] if self._steps else 0.0
        for i, (start, end, info) in enumerate(self._steps):
            info["host_start_s"] -= t0
            row = dict(info, gpu_ms=start.elapsed_time(end))
            if i + 1 < len(self._steps):
                row["idle_after_ms"] = end.elapsed_time(self._steps[i + 1][0])
            out.append(row)
        return out


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """Start a device->host copy into pinned memory (no wait); CPU tensors pass through."""
    if t is None or not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
