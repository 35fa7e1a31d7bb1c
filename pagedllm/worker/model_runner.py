"""ModelRunner: SchedulerOutput -> inputs -> forward -> logits | sample -> ModelRunnerOutput.

A step is two calls, with room between them for a token bitmask (structured output):
``execute_model(scheduler_output)`` applies the scheduler's diff to the persistent InputBatch,
gathers the scheduled rows into flat inputs (numpy), copies them to the device once, runs the model
(a CUDA graph for a pure decode step) and computes logits only at positions that produce tokens;
``sample_tokens(grammar_output)`` samples them, verifies draft tokens, and starts the copy of the
tokens to the host, returning a ``StepHandle`` whose ``result()`` is the ModelRunnerOutput.

Inputs are prepared by ``InputPreparer`` (input_prep.py). With async scheduling step N+1 is
prepared while step N runs, each token step N samples reaching step N+1 on the device;
``StepSyncPolicy`` says when the host must wait for step N instead.

Multi-token steps: a request scheduled with d draft tokens (``scheduled_spec_decode_tokens``)
computes its last known token plus the d drafts; logits are taken at all d + 1 positions, each is
sampled with the request's own parameters, and the drafts are accepted while they equal the token
sampled at their positions (StepHandle, spec_decode/rejection_sampler.py). A proposer
(spec_decode/, built by worker/proposer.py from ``speculative_config``) drafts the next ones.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    common_inputs_from_lists,
)
from pagedllm.attention.backend import forward_context as attention_forward_context
from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.distributed import get_pp_group
from pagedllm.sample.bitmask import BitmaskApplier, GrammarOutput
from pagedllm.sample.history import TokenHistory
from pagedllm.sample.logprobs import PromptLogprobs
from pagedllm.sample.sampler import Sampler, SamplerOutput, build_sampling_metadata
from pagedllm.spec_decode.interface import Proposer
from pagedllm.worker.cuda_graph import CUDAGraphRunner
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.input_prep import InputPreparer, PreparedInputs
from pagedllm.worker.pipeline_stage import stage_forward
from pagedllm.worker.step_handle import StepHandle, StepTrace
from pagedllm.worker.sync_policy import StepSyncPolicy

__all__ = ["ModelRunner", "StepHandle", "StepTrace"]  # StepTrace: for the benchmarks


@dataclass
class _LaunchedForward:
    """What ``execute_model`` leaves for ``sample_tokens``."""

    inputs: PreparedInputs
    hidden: torch.Tensor | None  # eager steps (prompt logprobs read it)
    logits: torch.Tensor | None  # model dtype, one row per logits index
    num_scheduled_tokens: dict[str, int]
    trace_start: object = None


class ModelRunner:
    """Steps one model over the InputBatch (see the module doc).

    Invariant: between steps, ``input_batch`` holds every live request the scheduler has sent,
    its tokens known on the host, and ``num_pending`` of them per row still on their way from the
    last launched step (whose device ids ``prep`` forwards). ``execute_model`` and
    ``sample_tokens`` alternate. Cost per step: O(scheduled tokens + scheduled requests) numpy work,
    one host->device copy, the forward, one sampler pass and one device->host copy; Python loops
    per request only to build the sampling parameters and to apply the returned tokens.
    """

    def __init__(self, config: EngineConfig, model: torch.nn.Module, backend: AttentionBackend,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.model = model
        self.backend = backend
        self.device = device
        self.dtype = dtype
        mc, sc = config.model_config, config.scheduler_config
        self.block_size = config.cache_config.block_size
        self.max_model_len = mc.max_model_len
        self.sampler = Sampler(seed=mc.seed, device=device)
        self.bitmask_applier = BitmaskApplier(device)  # structured output: its pinned staging buffers
        self.pp = get_pp_group()  # this rank's pipeline stage (the only stage at size 1)
        self.kv_caches: list[torch.Tensor] = []
        self.max_blocks_per_req = (self.max_model_len + self.block_size - 1) // self.block_size
        self.input_batch = InputBatch(sc.max_num_seqs, self.max_model_len, self.max_blocks_per_req)
        self.prompt_logprobs = PromptLogprobs()
        self.prep = InputPreparer(self.input_batch, backend, device, self.block_size,
                                  max(sc.max_num_batched_tokens, sc.max_num_seqs), sc.max_num_seqs,
                                  self.max_blocks_per_req)
        self.graph_runner: CUDAGraphRunner | None = None  # set by the worker after capture
        # LoRA (``enable_lora``): the worker's adapters and LoRA layers (lora/manager.py); None: off.
        self.lora_manager = None
        self.proposer: Proposer | None = None
        self.sync_policy = StepSyncPolicy(sc.max_num_seqs)
        self.timings: dict[str, float] = {"prepare": 0.0}
        self._forward: _LaunchedForward | None = None
        self._last_handle: StepHandle | None = None
        # Per-step GPU trace (bench --trace-steps): None = off, else a StepTrace.
        self.trace: StepTrace | None = None

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.model.bind_kv_caches(kv_caches)

    def dummy_metadata(self, query_lens: list[int], num_cached: int) -> AttentionMetadata:
        """Metadata of a start-up batch: requests with these query lengths after ``num_cached``
        earlier positions, every block in block 0, no KV writes (slot -1)."""
        common = common_inputs_from_lists(query_lens, [q + num_cached for q in query_lens],
                                          [[0] * self.max_blocks_per_req for _ in query_lens],
                                          [-1] * sum(query_lens), self.device)
        return self.backend.metadata_builder.build(common)

    # -- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> None:
        """Launch the step's inputs, forward and logits; nothing here waits for the GPU unless the
        sync policy says so."""
        self._update_states(so)
        self._forward = None
        if so.total_num_scheduled_tokens == 0:
            return
        batch = self.input_batch
        rows = np.fromiter((batch.req_id_to_row[r] for r in so.num_scheduled_tokens), dtype=np.int64,
                           count=len(so.num_scheduled_tokens))
        if self._last_handle is not None and self.sync_policy.must_wait(
                rows, batch.num_pending, bool(so.scheduled_spec_decode_tokens)):
            self._last_handle.result()
        trace_start = self.trace.begin() if self.trace is not None else None
        t0 = time.perf_counter()
        lora_slots, graph_runner = None, self.graph_runner
        if self.lora_manager is not None:
            lora_slots = self.lora_manager.prepare_step(batch.lora_int_id[rows], np.fromiter(
                so.num_scheduled_tokens.values(), dtype=np.int64, count=len(rows)))
            # No graphs with the delta (LoRA graphs are decode-only: with verify graphs too, a step
            # with adapters could be a verification): a step with adapters runs eagerly.
            if lora_slots is not None and (graph_runner is None or not graph_runner.lora_graphs
                                           or graph_runner.verify_sizes):
                graph_runner = None
        inp = self.prep.prepare(so, rows, graph_runner)
        self.timings["prepare"] += time.perf_counter() - t0
        hidden = logits = None
        if inp.graph_size is not None:  # a decode or verify graph (on the last stage it ends with the LM head)
            if lora_slots is None:  # a pipeline stage before the last sends its output and has no logits
                out = self.graph_runner.replay_stage(inp.graph_size, inp.graph_query_len,
                                                     so.total_num_scheduled_tokens)
                logits = None if out is None else out[inp.logits_indices]
            else:
                self.lora_manager.stage_graph(lora_slots)
                logits = self.graph_runner.replay_lora(inp.graph_size)[inp.logits_indices]
        else:
            lora_step = contextlib.nullcontext()
            if self.lora_manager is not None:  # None: the layers run without a delta
                lora_step = self.lora_manager.step(None if lora_slots is None
                                                   else self.lora_manager.eager_mapping(lora_slots))
            with attention_forward_context(inp.attn_metadata, self.backend), lora_step:
                hidden = stage_forward(self.model, self.pp, inp.input_ids, inp.positions, self.dtype)
            if inp.sample_req_idx and hidden is not None:  # None: a pipeline stage before the last
                # logits in the model dtype: the sampler upcasts where it needs
                logits = self.model.compute_logits(hidden[inp.logits_indices], upcast=False)
        self._forward = _LaunchedForward(inp, hidden, logits, so.num_scheduled_tokens, trace_start)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> StepHandle:
        """Sample the step ``execute_model`` launched (after applying ``grammar_output``'s bitmask)
        and start copying its tokens to the host."""
        fwd, self._forward = self._forward, None
        if fwd is None:
            return StepHandle.empty()
        inp, batch = fwd.inputs, self.input_batch
        handle = StepHandle(batch, inp.req_ids, inp.sample_req_idx, self.proposer)
        # No logits: nothing samples, or a pipeline stage before the last, which samples nothing
        # (the driver sends it the sampled ids with the next step: SchedulerOutput.new_token_ids).
        if fwd.logits is not None:
            rows = [batch.req_id_to_row[inp.req_ids[i]] for i in inp.sample_req_idx]
            params = [batch.params[r] for r in rows]
            if grammar_output is not None:
                self._apply_grammar(fwd.logits, inp, grammar_output)
            if inp.drafts is None:
                self._sample_one_per_request(handle, fwd.logits, rows, params)
            else:
                self._sample_with_drafts(handle, fwd.logits, rows, params, inp.drafts)
        # Prompt logprobs come from prefill chunks, which never run as a graph (hidden is set then).
        if fwd.hidden is not None:
            handle.prompt_logprobs = self.prompt_logprobs.compute(
                fwd.hidden, self.model.compute_logits, batch, inp.req_ids, inp.query_start_loc,
                fwd.num_scheduled_tokens)
        self._last_handle = handle
        if fwd.trace_start is not None:
            self.trace.end(fwd.trace_start, len(inp.req_ids), inp.query_start_loc, inp.seq_lens, inp.graph_size)
        return handle

    def _sample_one_per_request(self, handle: StepHandle, logits: torch.Tensor, rows: list[int], params: list) -> None:
        batch = self.input_batch
        rows_np = np.asarray(rows, dtype=np.int64)
        # Counts include tokens still in flight (async scheduling) so positions (seeds, min_tokens)
        # are exact; rows that read the ids themselves waited for them (StepSyncPolicy).
        result = self._sample(logits, rows_np, params, batch.num_tokens[rows_np] + batch.num_pending[rows_np])
        handle.launch_copies(result, rows, params)
        self.prep.sampled(result.token_ids, rows, np.arange(len(rows)))
        self.sync_policy.launched(None)

    def _sample_with_drafts(self, handle: StepHandle, logits: torch.Tensor, rows: list[int], params: list,
                            drafts: list[list[int]]) -> None:
        """Sample every logits row of the step (request i has len(drafts[i]) + 1 of them, the j-th
        over its known tokens plus its first j drafts); nothing is in flight (the policy waited)."""
        batch = self.input_batch
        rows_np = np.asarray(rows, dtype=np.int64)
        counts = np.fromiter((len(d) + 1 for d in drafts), dtype=np.int64, count=len(drafts))
        first = np.cumsum(counts) - counts
        row_of = np.repeat(rows_np, counts)
        offset = np.arange(int(counts.sum())) - np.repeat(first, counts)
        row_params = [p for p, c in zip(params, counts.tolist()) for _ in range(c)]
        result = self._sample(logits, row_of, row_params, batch.num_tokens[row_of] + offset)
        handle.launch_copies(result, rows, row_params, drafts)
        single = counts == 1  # requests without drafts may have their token forwarded to the next step
        self.prep.sampled(result.token_ids, rows_np[single], first[single])
        self.sync_policy.launched(rows_np[~single])

    def _sample(self, logits: torch.Tensor, rows: np.ndarray, params: list, num_tokens: np.ndarray) -> SamplerOutput:
        batch = self.input_batch
        history = TokenHistory(batch.token_ids, rows, batch.num_prompt_tokens[rows], num_tokens)
        meta = build_sampling_metadata(params, history, self.device, logits.shape[-1])
        return self.sampler(logits, meta)

    def _apply_grammar(self, logits: torch.Tensor, inp: PreparedInputs, grammar: GrammarOutput) -> None:
        """Mask the logits rows of the requests in ``grammar`` (their rows in request order)."""
        req_ids = inp.req_ids
        if inp.drafts is None:  # one row per sampled request
            row_of = {req_ids[i]: row for row, i in enumerate(inp.sample_req_idx)}
            idx = [row_of[req_id] for req_id in grammar.req_ids]
        else:
            first_row, row = {}, 0
            for j, i in enumerate(inp.sample_req_idx):
                n = len(inp.drafts[j]) + 1
                first_row[req_ids[i]] = (row, n)
                row += n
            idx = [r for req_id in grammar.req_ids for r in range(first_row[req_id][0], sum(first_row[req_id]))]
        self.bitmask_applier.apply(logits, idx, grammar.bitmask)

    # -- inputs ----------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            batch.remove(req_id)
        if self.proposer is not None and (so.finished_req_ids or so.preempted_req_ids):
            self.proposer.remove_requests(so.finished_req_ids | so.preempted_req_ids)
        for req_id in so.finished_req_ids:
            self.prompt_logprobs.forget(req_id)
        for new in so.scheduled_new_reqs:
            if self.lora_manager is not None:
                self.lora_manager.add_request(new.lora_request)
            row = batch.add(new)
            self.sync_policy.add_request(row, new.sampling_params)
            self.prep.inputs.queue_block_update(row, 0, new.block_ids)
        for cached in so.scheduled_cached_reqs:
            row = batch.req_id_to_row[cached.req_id]
            self.prep.inputs.queue_block_update(row, int(batch.num_blocks[row]), cached.new_block_ids)
            batch.append_blocks(row, cached.new_block_ids)
            batch.num_computed_tokens[row] = cached.num_computed_tokens
        if so.new_token_ids and not self.pp.is_last:
            self._write_pipeline_tokens(so)
        for req_id, (start, token_ids) in so.jump_forward_tokens.items():
            batch.replace_tokens(batch.req_id_to_row[req_id], start, token_ids)

    def _write_pipeline_tokens(self, so: SchedulerOutput) -> None:
        """A pipeline stage before the last (it never samples): write the output tokens the step
        computes, which the driver sends, where the step reads its input ids. O(those tokens)."""
        batch = self.input_batch
        for req_id, token_ids in so.new_token_ids.items():
            row = batch.req_id_to_row[req_id]
            end = int(batch.num_computed_tokens[row]) + so.num_scheduled_tokens[req_id]
            batch.token_ids[row, end - len(token_ids) : end] = token_ids
            batch.num_tokens[row] = max(int(batch.num_tokens[row]), end)
