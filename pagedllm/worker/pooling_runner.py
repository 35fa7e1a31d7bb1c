"""PoolingModelRunner: the runner of an embedding model (``runner="pooling"``).

Steps go through the scheduler like generation steps (prefill only: every request is its prompt),
but instead of logits and sampling a step pools: each scheduled request's chunk is reduced to a
partial (``layers/pooler.Pooler``), partials of a prompt computed over several steps (chunked
prefill of a causal model) are kept here and merged, and a request whose last prompt token was
computed this step gets its vector (mean division, ``dimensions`` truncation, normalization). The
vectors of a step are copied to the host at once; ``ModelRunnerOutput.pooler_output`` carries
them (request id -> float32 CPU tensor), and the scheduler then finishes those requests and frees
their blocks in the same update.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from pagedllm.attention.backend import forward_context as attention_forward_context
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.layers.pooler import Pooler
from pagedllm.pooling_params import PoolingParams
from pagedllm.sample.bitmask import GrammarOutput
from pagedllm.worker.model_runner import ModelRunner


class PooledStep:
    """One step's pooled vectors on their way to the host; ``result()`` waits for the copy once and
    returns the ModelRunnerOutput (no tokens; ``pooler_output`` for the finished requests)."""

    def __init__(self, req_ids: list[str], finished: list[str], vectors: torch.Tensor | None,
                 lengths: list[int]) -> None:
        self.req_ids = req_ids
        self._finished, self._lengths = finished, lengths
        self._host = None
        self._event = None
        self._output: ModelRunnerOutput | None = None
        if vectors is not None:
            pinned = vectors.is_cuda
            self._host = torch.empty(vectors.shape, dtype=vectors.dtype, pin_memory=pinned)
            self._host.copy_(vectors, non_blocking=pinned)
            if pinned:
                self._event = torch.cuda.Event()
                self._event.record()

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            if self._event is not None:
                self._event.synchronize()
            pooled = {r: self._host[i, :n] for i, (r, n) in enumerate(zip(self._finished, self._lengths))}
            self._output = ModelRunnerOutput(req_ids=self.req_ids, sampled_token_ids=[[] for _ in self.req_ids],
                                             pooler_output=pooled)
        return self._output


class PoolingModelRunner(ModelRunner):
    """The ModelRunner's state handling and input preparation, with pooling instead of sampling.

    Invariant: ``_partials`` holds, for every live request whose prompt is partly computed, the
    merged partial of its computed tokens (float32 ``[hidden]``); ``_params`` the PoolingParams of
    every live request (the engine resolved ``normalize``). Both forget a request when the
    scheduler reports it finished or preempted. Cost per step: the forward, one pooling reduction
    and one device->host copy of the finished requests' vectors.
    """

    def __init__(self, *args, pooling_type: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pooler = Pooler(pooling_type)
        self._partials: dict[str, torch.Tensor] = {}
        self._params: dict[str, PoolingParams] = {}
        self._pooled: PooledStep | None = None

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self._partials.pop(req_id, None)
            if req_id in so.finished_req_ids:
                self._params.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            if new.pooling_params is None:
                raise ValueError(f"request {new.req_id!r} has no pooling_params: a pooling runner runs pooling only")
            self._params[new.req_id] = new.pooling_params
        self._update_states(so)
        self._pooled = None
        if so.total_num_scheduled_tokens == 0:
            return
        batch = self.input_batch
        rows = np.fromiter((batch.req_id_to_row[r] for r in so.num_scheduled_tokens), dtype=np.int64,
                           count=len(so.num_scheduled_tokens))
        t0 = time.perf_counter()
        inp = self.prep.prepare(so, rows, None)
        self.timings["prepare"] += time.perf_counter() - t0
        with attention_forward_context(inp.attn_metadata, self.backend):
            hidden = self.model(inp.input_ids, inp.positions)
        num_reqs = len(inp.req_ids)
        chunks = self.pooler.chunk_partials(hidden, inp.attn_metadata.query_start_loc, num_reqs)
        self._pooled = self._finish(inp.req_ids, inp.sample_req_idx, chunks, inp.seq_lens[:num_reqs].copy())

    def _finish(self, req_ids: list[str], finished_idx: list[int], chunks: torch.Tensor,
                seq_lens: np.ndarray) -> PooledStep:
        """Merge the chunks with earlier partials; keep the unfinished ones; finish the others."""
        partials = self._merge_partials(req_ids, finished_idx, chunks)
        if not finished_idx:
            return PooledStep(req_ids, [], None, [])
        finished = [req_ids[i] for i in finished_idx]
        params = [self._params.pop(r) for r in finished]
        hidden_size = int(chunks.shape[1])
        lengths = [p.dimensions or hidden_size for p in params]
        device = chunks.device
        if len(finished_idx) < len(req_ids):
            partials = partials.index_select(0, torch.as_tensor(finished_idx, device=device))
            seq_lens = seq_lens[finished_idx]
        # The three per-request arguments travel to the device as one int64 tensor (one copy).
        per_request = torch.as_tensor(np.stack([seq_lens, lengths, [bool(p.normalize) for p in params]]),
                                      dtype=torch.int64).to(device, non_blocking=True)
        vectors = self.pooler.finish(partials, per_request[0], per_request[1], per_request[2].bool())
        return PooledStep(req_ids, finished, vectors, lengths)

    def _merge_partials(self, req_ids: list[str], finished_idx: list[int], chunks: torch.Tensor) -> torch.Tensor:
        """``chunks`` merged with the earlier partials of their requests; the unfinished ones are
        kept for the next step. An encoder's step (every prompt whole, all finished) skips the loop."""
        if not self._partials and len(finished_idx) == len(req_ids):
            return chunks
        finished_set = set(finished_idx)
        partials = chunks
        for i, req_id in enumerate(req_ids):
            earlier = self._partials.pop(req_id, None)
            if earlier is not None:
                partials = partials if partials is not chunks else chunks.clone()
                partials[i] = self.pooler.merge(earlier, chunks[i])
            if i not in finished_set:
                self._partials[req_id] = partials[i].clone()
        return partials

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> PooledStep:
        """No sampling: hand back the step's pooled vectors (``grammar_output`` is always None here:
        a pooling request has no grammar)."""
        pooled, self._pooled = self._pooled, None
        return pooled if pooled is not None else PooledStep([], [], None, [])
