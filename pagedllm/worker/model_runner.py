"""ModelRunner: SchedulerOutput -> tensors -> forward -> sample -> ModelRunnerOutput.

The runner owns the model, the KV cache tensors, the persistent InputBatch and the sampler.
Per step: apply the scheduler's diff to the InputBatch, gather the scheduled rows into flat
inputs (numpy), copy them to the device once, run the model under a scoped forward context,
compute logits only at positions that produce a token, sample, and copy the tokens back once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata, forward_context, get_attention_backend
from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from pagedllm.layers.dispatch import prepare_model_kernels
from pagedllm.sample.history import TokenHistory
from pagedllm.sample.logprobs import prompt_logprobs
from pagedllm.sample.sampler import Sampler, SamplerOutput, build_sampling_metadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker import kv_cache as kvc
from pagedllm.worker.cuda_graph import CUDAGraphRunner
from pagedllm.worker.device_inputs import LONGEST_FIRST_FROM, DeviceInputs, stage_longest_first
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.parallel_compile import compile_only


def needs_token_history(params) -> bool:
    """Whether sampling reads the request's exact past token ids (not just their count)."""
    return bool(
        params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
        or params._bad_words_token_ids
    )


logger = logging.getLogger("pagedllm")

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# On CUDA the decoder layers' norm weights are folded into the projections after them, which lets
# the model run its residual-stream forward (models/llama.py); PAGEDLLM_FOLD_NORMS=0 keeps them.


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    # Token index of each sampling request's last scheduled token (a slice when they are 0..n-1).
    logits_indices: torch.Tensor | slice
    req_ids: list[str]  # scheduled requests in batch order
    sample_req_idx: list[int]  # indices into req_ids of the requests that produce a token
    graph_size: int | None = None  # padded decode batch size to replay, None = eager


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.models.registry import build_model, init_dummy_weights, load_model

        self.config = config
        mc = config.model_config
        self.device = torch.device(config.device)
        self.dtype = _TORCH_DTYPES[mc.dtype]
        self.block_size = config.cache_config.block_size
        self.max_model_len = mc.max_model_len
        t0 = time.perf_counter()
        if mc.load_format == "dummy":
            self.model = init_dummy_weights(build_model(mc.hf_config, self.dtype, self.device), seed=mc.seed)
        else:
            self.model = load_model(mc.source, mc.hf_config, self.dtype, self.device)
        self.model.eval()
        self.kernel_plan = prepare_model_kernels(self.model, self.device, config.kernel_config)
        logger.info("model loaded in %.1f s", time.perf_counter() - t0)
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.sampler = Sampler(seed=mc.seed, device=self.device)
        self.kv_caches: list[torch.Tensor] = []
        sc = config.scheduler_config
        self.max_blocks_per_req = (self.max_model_len + self.block_size - 1) // self.block_size
        self.input_batch = InputBatch(sc.max_num_seqs, self.max_model_len, self.max_blocks_per_req)
        # req_id -> prompt positions whose logprobs were already reported (survives preemption).
        self.prompt_logprobs_done: dict[str, int] = {}
        self.inputs = DeviceInputs(max(sc.max_num_batched_tokens, sc.max_num_seqs), sc.max_num_seqs,
                                   self.max_blocks_per_req, self.device)
        self.graph_runner: CUDAGraphRunner | None = None
        self.timings: dict[str, float] = {"prepare": 0.0}
        self._last_handle: StepHandle | None = None
        self._last_sampled: torch.Tensor | None = None  # device ids of the last launched step
        # Row -> index of that row's token in ``_last_sampled`` (-1: it sampled nothing then).
        self._last_sample_index = np.full(sc.max_num_seqs, -1, dtype=np.int64)
        # Rows whose sampling reads their exact token history (penalties, bad words): a step with
        # such a row first waits for the previous step's tokens.
        self._needs_history = np.zeros(sc.max_num_seqs, dtype=bool)
        # Per-step GPU trace (bench --trace-steps): None = off, else a StepTrace.
        self.trace: StepTrace | None = None

    # -- KV cache --------------------------------------------------------------------------
    def block_bytes(self) -> int:
        mc = self.config.model_config
        return kvc.bytes_per_block(self.model.num_attention_layers, self.block_size, mc.num_kv_heads, mc.head_dim, self.dtype)

    def determine_num_blocks(self) -> int:
        """How many KV blocks to allocate: a fixed byte budget on the CPU, a memory profile on CUDA."""
        cfg = self.config
        if cfg.cache_config.num_gpu_blocks_override:
            return cfg.cache_config.num_gpu_blocks_override
        sc = cfg.scheduler_config
        if self.device.type != "cuda":
            return kvc.cpu_num_blocks(cfg.cache_config.kv_cache_memory, self.block_bytes(), self.block_size,
                                      sc.max_num_seqs, self.max_model_len)
        t0 = time.perf_counter()
        peak = self._profile_peak_memory()
        logger.info("memory profile (one forward of %d tokens) in %.1f s: peak %.2f GiB",
                    sc.max_num_batched_tokens, time.perf_counter() - t0, peak / 2**30)
        num_blocks = kvc.cuda_num_blocks(self.device, cfg.cache_config.gpu_memory_utilization, peak,
                                         self.block_bytes())
        return min(num_blocks, sc.max_num_seqs * self.max_blocks_per_req + 1)

    @torch.inference_mode()
    def _profile_peak_memory(self) -> int:
        """Run the largest batch the scheduler can produce once (KV writes skipped) and return the
        peak bytes allocated by torch."""
        sc = self.config.scheduler_config
        num_tokens = sc.max_num_batched_tokens
        lens = []
        while sum(lens) < num_tokens:
            lens.append(min(self.max_model_len, num_tokens - sum(lens)))
        dummy_cache = self.model.kv_cache_shape_per_layer(1, self.block_size)
        self.model.bind_kv_caches(kvc.allocate_kv_caches(self.model.num_attention_layers, dummy_cache,
                                                         self.dtype, self.device))
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        dev = self.device
        meta = AttentionMetadata(
            num_actual_tokens=num_tokens, max_query_len=max(lens), max_seq_len=max(lens),
            query_start_loc=torch.from_numpy(qsl).to(dev), seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.zeros((len(lens), self.max_blocks_per_req), dtype=torch.int32, device=dev),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=lens,
        )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        self._compile_in_parallel(meta, ids)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        with forward_context(meta, self.backend):
            hidden = self.model(ids, ids)
        logits = self.model.compute_logits(hidden[: sc.max_num_seqs])
        torch.softmax(logits, dim=-1).sort(dim=-1)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        del hidden, logits
        self.model.bind_kv_caches([])
        torch.cuda.empty_cache()
        return int(peak)

    def warm_up(self) -> None:
        """After the KV cache exists (GPU): compile every kernel variant an eager step can take, then
        capture the decode CUDA graphs (unless enforce_eager). Nothing compiles while serving."""
        if self.device.type != "cuda":
            return
        t0 = time.perf_counter()
        self._warm_up_eager_kernels()
        logger.info("compiled the prefill / mixed-step kernels in %.1f s", time.perf_counter() - t0)
        if not self.config.enforce_eager:
            graphs = self._graph_runner_for_warm_up()
            self._tune_gemm_library(graphs.sizes)
            graphs.capture_all()

    def _tune_gemm_library(self, batch_sizes: list[int]) -> None:
        """Pick cuBLAS or cuBLASLt per weight shape and CUDA-graph batch size (``KernelPlan.tune_gemms``),
        before the graphs capture the choice. ``KernelConfig.gemm_tuning`` off keeps cuBLAS everywhere."""
        if not self.config.kernel_config.gemm_tuning:
            return
        summary = self.kernel_plan.tune_gemms(self.model, batch_sizes)
        logger.info("GEMM library: cuBLASLt for %d of %d (weight shape, batch size) pairs, timed in %.1f s",
                    summary["cublaslt"], summary["measured"], summary["seconds"])

    def _graph_runner_for_warm_up(self) -> CUDAGraphRunner:
        if self.graph_runner is None:
            self.graph_runner = CUDAGraphRunner(self.model, self.backend, self.inputs,
                                                self.config.scheduler_config.max_num_seqs, self.device)
        return self.graph_runner

    def _compile_in_parallel(self, profile_meta: AttentionMetadata, profile_ids: torch.Tensor) -> None:
        """A dry pass over every forward start-up runs (the memory profile, the eager warm-up shapes,
        one decode per CUDA-graph size, the sampler's greedy and random launches) that compiles their
        Triton kernels in parallel; the real passes then only launch (with the sampler in the dry
        pass, a cold start on an H100 took 20.1-20.4 s to the first token instead of 22.1-22.4 s).
        Needs the (dummy) KV caches bound; see worker/parallel_compile.py."""
        t0 = time.perf_counter()
        with compile_only() as active:
            if not active:
                return
            with forward_context(profile_meta, self.backend):
                self.model(profile_ids, profile_ids)
            self._warm_up_eager_kernels()
            if not self.config.enforce_eager:
                self._graph_runner_for_warm_up().run_all_sizes()
            t1 = time.perf_counter()
        logger.info("compiled the start-up kernels in parallel in %.1f s (dry pass %.1f s)",
                    time.perf_counter() - t0, t1 - t0)

    @torch.inference_mode()
    def _warm_up_eager_kernels(self) -> None:
        """Run eager forwards of 1 and 2 decodes (the small-M GEMV, eager decode attention), then of one
        decode plus one prefill of 2, 4, .., 64 tokens (each length picks another attention tile
        height), logits, and both sampling kernels (greedy and the fused random draw). Slots are -1
        (the cache is not written); contexts are 2 tokens longer than the query and read block 0."""
        batches = [[1], [1, 1]] + [[1, n] for n in (2, 4, 8, 16, 32, 64)]
        hidden = None
        for query_lens in batches:
            if max(query_lens) + 2 > self.max_model_len:
                break
            hidden = self._eager_dummy_forward(query_lens)
        if hidden is None:
            return
        logits = self.model.compute_logits(hidden[[0, hidden.shape[0] - 1]], upcast=False)  # as in a step
        for temperature in (0.0, 1.0):
            params = [SamplingParams(temperature=temperature, max_tokens=1)] * 2
            history = TokenHistory(np.zeros((2, 1), dtype=np.int64), np.arange(2), np.ones(2, dtype=np.int64),
                                   np.ones(2, dtype=np.int64))
            self.sampler(logits, build_sampling_metadata(params, history, self.device, logits.shape[-1]))
        torch.cuda.synchronize(self.device)

    def _eager_dummy_forward(self, query_lens: list[int]) -> torch.Tensor:
        """One eager forward of requests with these query lengths, each over a context of its query
        plus 2 earlier positions; nothing is written to the KV cache."""
        dev = self.device
        lens = [q + 2 for q in query_lens]
        qsl = np.concatenate([[0], np.cumsum(query_lens)]).tolist()
        n = qsl[-1]
        meta = AttentionMetadata(
            num_actual_tokens=n, max_query_len=max(query_lens), max_seq_len=max(lens),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.zeros((len(lens), self.max_blocks_per_req), dtype=torch.int32, device=dev),
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),
            query_start_loc_cpu=qsl, seq_lens_cpu=lens,
        )
        positions = torch.cat([torch.arange(2, 2 + q) for q in query_lens]).to(dev)
        with forward_context(meta, self.backend):
            return self.model(torch.zeros(n, dtype=torch.long, device=dev), positions)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = self.model.kv_cache_shape_per_layer(num_blocks, self.block_size)
        self.kv_caches = kvc.allocate_kv_caches(self.model.num_attention_layers, shape, self.dtype, self.device)
        self.model.bind_kv_caches(self.kv_caches)

    # -- one step --------------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its tokens."""
        return self.execute_model_async(so).result()

    @torch.inference_mode()
    def execute_model_async(self, so: SchedulerOutput) -> StepHandle:
        """Launch one step on the device and return at once (on CUDA nothing here waits for the
        GPU unless a request needs the exact token history, e.g. penalties). ``result()`` of the
        returned handle waits for the sampled tokens."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return StepHandle.empty()
        if self._last_handle is not None and self._history_needed(so):
            self._last_handle.result()  # penalties etc. need the previous step's tokens on the host
        trace_start = self.trace.begin() if self.trace is not None else None
        t0 = time.perf_counter()
        inp = self._prepare_inputs(so)
        self.timings["prepare"] += time.perf_counter() - t0
        hidden = graph_logits = None
        if inp.graph_size is not None:  # the graph ends with the LM head (a pure decode step)
            graph_logits = self.graph_runner.replay(inp.graph_size)
        else:
            with forward_context(inp.attn_metadata, self.backend):
                hidden = self.model(inp.input_ids, inp.positions)
        handle = StepHandle(self.input_batch, inp.req_ids, inp.sample_req_idx)
        if inp.sample_req_idx:
            # Logits in the model dtype: the sampler upcasts where it needs float32.
            if graph_logits is not None:
                logits = graph_logits[inp.logits_indices]
            else:
                logits = self.model.compute_logits(hidden[inp.logits_indices], upcast=False)
            rows = [self.input_batch.req_id_to_row[inp.req_ids[i]] for i in inp.sample_req_idx]
            params = [self.input_batch.params[r] for r in rows]
            result = self._sample(logits, rows, params)
            handle.launch_copies(result, rows, params)
            self._last_sampled = result.token_ids
            self._last_sample_index[:] = -1
            self._last_sample_index[rows] = np.arange(len(rows))
        # Prompt logprobs come from prefill chunks, which never run as a graph (hidden is set then).
        handle.prompt_logprobs = self._prompt_logprobs(hidden, inp, so) if hidden is not None else {}
        self._last_handle = handle
        if trace_start is not None:
            self.trace.end(trace_start, inp)
        return handle

    def _sample(self, logits: torch.Tensor, rows: list[int], params: list) -> SamplerOutput:
        batch = self.input_batch
        rows_np = np.asarray(rows, dtype=np.int64)
        # Counts include a token still in flight (async scheduling) so positions (seeds, min_tokens)
        # are exact; rows that read the ids themselves waited for it (see _history_needed).
        num_tokens = batch.num_tokens[rows_np] + batch.num_pending[rows_np]
        history = TokenHistory(batch.token_ids, rows_np, batch.num_prompt_tokens[rows_np], num_tokens)
        meta = build_sampling_metadata(params, history, self.device, logits.shape[-1])
        return self.sampler(logits, meta)

    def _prompt_logprobs(self, hidden: torch.Tensor, inp: PreparedInputs, so: SchedulerOutput):
        """Raw logprobs of the prompt tokens predicted by positions computed this step, for requests
        with prompt_logprobs (position p predicts prompt token p + 1; the last prompt position
        samples instead). Positions reported before a preemption are not reported again."""
        batch, out = self.input_batch, {}
        for i, req_id in enumerate(inp.req_ids):
            row = batch.req_id_to_row[req_id]
            k = batch.params[row].prompt_logprobs
            if k is None:
                continue
            end = int(batch.num_computed_tokens[row])  # already advanced past this step
            chunk_start = end - so.num_scheduled_tokens[req_id]
            start = max(chunk_start, self.prompt_logprobs_done.get(req_id, 0))
            stop = min(end, int(batch.num_prompt_tokens[row]) - 1)
            if start >= stop:
                continue
            first = inp.attn_metadata.query_start_loc_cpu[i] + start - chunk_start
            next_ids = torch.from_numpy(batch.token_ids[row, start + 1 : stop + 1].copy()).to(hidden.device)
            out[req_id] = prompt_logprobs(hidden[first : first + stop - start], self.model.compute_logits, next_ids, k)
            self.prompt_logprobs_done[req_id] = stop
        return out

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            batch.remove(req_id)
        for req_id in so.finished_req_ids:
            self.prompt_logprobs_done.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            row = batch.add(new)
            self._needs_history[row] = needs_token_history(new.sampling_params)
            self.inputs.queue_block_update(row, 0, new.block_ids)
        for cached in so.scheduled_cached_reqs:
            row = batch.req_id_to_row[cached.req_id]
            self.inputs.queue_block_update(row, int(batch.num_blocks[row]), cached.new_block_ids)
            batch.append_blocks(row, cached.new_block_ids)
            batch.num_computed_tokens[row] = cached.num_computed_tokens

    def _prepare_inputs(self, so: SchedulerOutput) -> PreparedInputs:
        """Gather the scheduled rows into flat inputs (vectorised numpy into the staging buffers),
        pad a pure-decode batch to a captured graph size, and copy everything to the device."""
        batch = self.input_batch
        req_ids = list(so.num_scheduled_tokens.keys())
        num_reqs = len(req_ids)
        rows = np.fromiter((batch.req_id_to_row[r] for r in req_ids), dtype=np.int64, count=num_reqs)
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
        total = int(num_sched.sum())
        max_query_len = int(num_sched.max())
        graph_size = self._graph_size(num_reqs, max_query_len)
        stage = self.inputs.begin_step(*((graph_size, graph_size) if graph_size is not None else (total, num_reqs)))
        start = batch.num_computed_tokens[rows]
        seq_lens = start + num_sched
        qsl = stage["query_start_loc"]
        qsl[0] = 0
        np.cumsum(num_sched, out=qsl[1 : num_reqs + 1])
        # Flat per-token indices: which row, which position.
        tok_row = np.repeat(rows, num_sched)
        positions = np.arange(total, dtype=np.int64) - np.repeat(qsl[:num_reqs] - start, num_sched)
        stage["positions"][:total] = positions
        stage["input_ids"][:total] = batch.token_ids[tok_row, positions]
        stage["slot_mapping"][:total] = (
            batch.block_table[tok_row, positions // self.block_size] * self.block_size + positions % self.block_size
        )
        stage["seq_lens"][:num_reqs] = seq_lens
        stage["rows"][:num_reqs] = rows
        known = batch.num_tokens[rows]
        sample_idx = np.nonzero(seq_lens == known + batch.num_pending[rows])[0]
        self._stage_pending_tokens(rows, start, seq_lens, known, qsl[:num_reqs])
        stage["logits_indices"][: len(sample_idx)] = qsl[1:][sample_idx] - 1
        # After this step these tokens are computed (the scheduler sends the authoritative value).
        batch.num_computed_tokens[rows] = seq_lens
        n_tok, n_req = total, num_reqs
        if graph_size is not None:
            n_tok = n_req = graph_size
            self._pad_decode_batch(total, num_reqs, graph_size)
        return self._to_device_inputs(req_ids, sample_idx, n_tok, n_req, total, max_query_len, seq_lens, graph_size)

    def _stage_pending_tokens(self, rows, start, seq_lens, known, first_token) -> None:
        """Rows whose next input token was sampled by the step still in flight: stage (index in
        this step's input_ids, index in the previous step's sampled ids) pairs for a device copy."""
        pending = np.nonzero((self.input_batch.num_pending[rows] > 0) & (known >= start) & (known < seq_lens))[0]
        self._num_pending_copies = len(pending)
        self._pending_in_order = False
        if len(pending):
            stage = self.inputs.np
            dst = stage["pending_dst"][: len(pending)]
            src = stage["pending_src"][: len(pending)]
            dst[:] = first_token[pending] + known[pending] - start[pending]
            src[:] = self._last_sample_index[rows[pending]]
            # Steady decode: token i of this step is sampled id i of the last one (one plain copy).
            order = np.arange(len(pending))
            self._pending_in_order = bool(np.array_equal(dst, order) and np.array_equal(src, order))

    def _history_needed(self, so: SchedulerOutput) -> bool:
        batch = self.input_batch
        rows = [batch.req_id_to_row[r] for r in so.num_scheduled_tokens if r in batch.req_id_to_row]
        return bool(self._needs_history[rows].any() and batch.num_pending[rows].any())

    def _graph_size(self, num_reqs: int, max_query_len: int) -> int | None:
        if self.graph_runner is None or max_query_len != 1 or num_reqs > self.graph_runner.max_size:
            return None
        return self.graph_runner.padded_size(num_reqs)

    def _pad_decode_batch(self, num_tokens: int, num_reqs: int, size: int) -> None:
        """Padding rows: token 0 at position 0, slot -1 (no KV write), empty context."""
        stage = self.inputs.np
        stage["input_ids"][num_tokens:size] = 0
        stage["positions"][num_tokens:size] = 0
        stage["slot_mapping"][num_tokens:size] = -1
        stage["seq_lens"][num_reqs:size] = 0
        stage["rows"][num_reqs:size] = 0
        stage["query_start_loc"][num_reqs + 1 : size + 1] = np.arange(num_tokens + 1, num_tokens + 1 + size - num_reqs)

    def _to_device_inputs(self, req_ids, sample_idx, n_tok, n_req, total, max_query_len, seq_lens, graph_size):
        stage = self.inputs.np
        use_order = n_req >= LONGEST_FIRST_FROM and self.device.type == "cuda"
        if use_order:
            stage_longest_first(stage["decode_order"], stage["seq_lens"][:n_req])
        self.inputs.flush_block_updates()
        dev = self.inputs.copy_to_device()  # every staged field, in one copy
        meta = AttentionMetadata(
            num_actual_tokens=n_tok if graph_size is not None else total,
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()),
            query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"],
            block_tables=self.inputs.gather_block_tables(dev["rows"], n_req),
            slot_mapping=dev["slot_mapping"],
            query_start_loc_cpu=stage["query_start_loc"].tolist(),
            seq_lens_cpu=stage["seq_lens"].tolist(),
            decode_order=dev["decode_order"] if use_order else None,
        )
        input_ids = dev["input_ids"]
        if self._num_pending_copies:
            n = self._num_pending_copies
            if self._pending_in_order:
                input_ids[:n].copy_(self._last_sampled[:n])
            else:
                input_ids.index_copy_(0, dev["pending_dst"][:n], self._last_sampled[dev["pending_src"][:n]])
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
            graph_size=graph_size,
        )

    @staticmethod
    def _logprobs_lists(result: SamplerOutput, sample_req_idx, params, num_reqs):
        if result.logprobs is None:
            return None
        out: list[list[TokenLogprobs] | None] = [None] * num_reqs
        ids = result.logprob_token_ids.tolist()
        lps = result.logprobs.tolist()
        ranks = result.sampled_ranks.tolist()
        for j, (i, p) in enumerate(zip(sample_req_idx, params)):
            if p.logprobs is None:
                continue
            k = p.logprobs
            top_ids, top_lps = ids[j][1 : 1 + k], lps[j][1 : 1 + k]
            out[i] = [TokenLogprobs([ids[j][0], *top_ids], [lps[j][0], *top_lps], [ranks[j], *range(1, k + 1)])]
        return out


class StepTrace:
    """CUDA events around every launched step, for the benchmark's per-step breakdown. Recording
    an event does not wait for the GPU; ``rows()`` synchronizes once at the end. Event ``start``
    fires when the GPU reaches the step, ``end`` when it finishes the step's sampling and copies;
    the gap from one step's end to the next one's start is time the GPU sat idle."""

    def __init__(self) -> None:
        self._steps: list = []

    def begin(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev, time.perf_counter()

    def end(self, begun, inp: PreparedInputs) -> None:
        start, host_start = begun
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        meta = inp.attn_metadata
        qsl = np.asarray(meta.query_start_loc_cpu)
        query_lens = np.diff(qsl)[: len(inp.req_ids)]
        seq_lens = np.asarray(meta.seq_lens_cpu[: len(inp.req_ids)], dtype=np.int64)
        self._steps.append((start, ev, {
            "num_reqs": len(inp.req_ids),
            "num_tokens": int(query_lens.sum()),
            "num_decodes": int((query_lens == 1).sum()),
            "sum_seq_lens": int(seq_lens.sum()),
            "sum_decode_seq_lens": int(seq_lens[query_lens == 1].sum()),
            "graph_size": inp.graph_size,
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


class StepHandle:
    """One launched step: the sampled ids (and logprobs) are being copied to pinned host memory;
    ``result()`` waits on an event for them, applies them to the InputBatch once, and returns the
    ModelRunnerOutput. Rows that were freed (or freed and reused) meanwhile are skipped.

    It holds the runner's InputBatch, not the runner: the runner keeps its last handle, and a
    runner <-> handle cycle would outlive the engine (the engine core freezes the garbage collector's
    view of everything built at start-up), keeping the model and the KV cache on the GPU."""

    def __init__(self, batch: InputBatch | None, req_ids: list[str], sample_req_idx: list[int]) -> None:
        self.batch = batch
        self.req_ids = req_ids
        self.sample_req_idx = sample_req_idx
        self.prompt_logprobs: dict = {}
        self._rows: list[int] = []
        self._gens: list[int] = []
        self._params: list = []
        self._host: SamplerOutput | None = None
        self._event = None
        self._output: ModelRunnerOutput | None = None

    @classmethod
    def empty(cls) -> StepHandle:
        handle = cls(None, [], [])
        handle._output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        return handle

    def launch_copies(self, result: SamplerOutput, rows: list[int], params: list) -> None:
        batch = self.batch
        self._rows, self._params = rows, params
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
        batch = self.batch
        sampled: list[list[int]] = [[] for _ in self.req_ids]
        logprobs_out = None
        if self._host is not None:
            token_ids = self._host.token_ids.tolist()
            for i, row, gen, tok in zip(self.sample_req_idx, self._rows, self._gens, token_ids):
                if batch.generation[row] == gen and batch.num_pending[row] > 0:
                    batch.num_pending[row] -= 1
                    batch.append_token(row, tok)
                sampled[i] = [tok]
            logprobs_out = ModelRunner._logprobs_lists(self._host, self.sample_req_idx, self._params, len(self.req_ids))
        self._output = ModelRunnerOutput(req_ids=self.req_ids, sampled_token_ids=sampled, logprobs=logprobs_out,
                                         prompt_logprobs=self.prompt_logprobs)
        return self._output


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """Start a device->host copy into pinned memory (no wait); CPU tensors pass through."""
    if t is None or not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
