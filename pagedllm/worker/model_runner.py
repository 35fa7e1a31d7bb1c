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
from pagedllm.sample.sampler import Sampler, SamplerOutput, build_sampling_metadata
from pagedllm.worker import kv_cache as kvc
from pagedllm.worker.input_batch import InputBatch

logger = logging.getLogger("pagedllm")

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # token index of each sampling request's last scheduled token
    req_ids: list[str]  # scheduled requests in batch order
    sample_req_idx: list[int]  # indices into req_ids of the requests that produce a token


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.models.registry import load_model

        self.config = config
        mc = config.model_config
        self.device = torch.device(config.device)
        self.dtype = _TORCH_DTYPES[mc.dtype]
        self.block_size = config.cache_config.block_size
        self.max_model_len = mc.max_model_len
        t0 = time.perf_counter()
        self.model = load_model(mc.source, mc.hf_config, self.dtype, self.device)
        self.model.eval()
        logger.info("model loaded in %.1f s", time.perf_counter() - t0)
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.sampler = Sampler(seed=mc.seed, device=self.device)
        self.kv_caches: list[torch.Tensor] = []
        sc = config.scheduler_config
        self.max_blocks_per_req = (self.max_model_len + self.block_size - 1) // self.block_size
        self.input_batch = InputBatch(sc.max_num_seqs, self.max_model_len, self.max_blocks_per_req)

    # -- KV cache --------------------------------------------------------------------------
    def block_bytes(self) -> int:
        mc = self.config.model_config
        return kvc.bytes_per_block(self.model.num_attention_layers, self.block_size, mc.num_kv_heads, mc.head_dim, self.dtype)

    def determine_num_blocks(self) -> int:
        """How many KV blocks to allocate: a fixed byte budget on the CPU, a memory profile on CUDA."""
        cfg = self.config
        if cfg.extra.get("num_gpu_blocks_override"):
            return int(cfg.extra["num_gpu_blocks_override"])
        sc = cfg.scheduler_config
        if self.device.type != "cuda":
            return kvc.cpu_num_blocks(cfg.extra.get("kv_cache_memory"), self.block_bytes(), self.block_size,
                                      sc.max_num_seqs, self.max_model_len)
        peak = self._profile_peak_memory()
        num_blocks = kvc.cuda_num_blocks(self.device, cfg.extra.get("gpu_memory_utilization", 0.9), peak,
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
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
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
        """Hook for start-up work after the KV cache exists (CUDA graph capture on the GPU)."""

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = self.model.kv_cache_shape_per_layer(num_blocks, self.block_size)
        self.kv_caches = kvc.allocate_kv_caches(self.model.num_attention_layers, shape, self.dtype, self.device)
        self.model.bind_kv_caches(self.kv_caches)

    # -- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        inp = self._prepare_inputs(so)
        with forward_context(inp.attn_metadata, self.backend):
            hidden = self.model(inp.input_ids, inp.positions)
        sample_reqs = [inp.req_ids[i] for i in inp.sample_req_idx]
        sampled: list[list[int]] = [[] for _ in inp.req_ids]
        logprobs_out: list[list[TokenLogprobs] | None] | None = None
        if sample_reqs:
            logits = self.model.compute_logits(hidden[inp.logits_indices])
            rows = [self.input_batch.req_id_to_row[r] for r in sample_reqs]
            params = [self.input_batch.params[r] for r in rows]
            out_pos = [int(self.input_batch.num_tokens[r] - self.input_batch.num_prompt_tokens[r]) for r in rows]
            meta = build_sampling_metadata(params, out_pos, self.device)
            result = self.sampler(logits, meta)
            token_ids = result.token_ids.tolist()
            for i, row, tok in zip(inp.sample_req_idx, rows, token_ids):
                self.input_batch.append_token(row, tok)
                sampled[i] = [tok]
            logprobs_out = self._logprobs_lists(result, inp.sample_req_idx, params, len(inp.req_ids))
        return ModelRunnerOutput(req_ids=inp.req_ids, sampled_token_ids=sampled, logprobs=logprobs_out)

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            batch.remove(req_id)
        for new in so.scheduled_new_reqs:
            batch.add(new)
        for cached in so.scheduled_cached_reqs:
            row = batch.req_id_to_row[cached.req_id]
            batch.append_blocks(row, cached.new_block_ids)
            batch.num_computed_tokens[row] = cached.num_computed_tokens

    def _prepare_inputs(self, so: SchedulerOutput) -> PreparedInputs:
        batch = self.input_batch
        req_ids = list(so.num_scheduled_tokens.keys())
        rows = np.array([batch.req_id_to_row[r] for r in req_ids], dtype=np.int64)
        num_sched = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        start = batch.num_computed_tokens[rows]
        seq_lens = start + num_sched
        qsl = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_sched, out=qsl[1:])
        total = int(qsl[-1])
        # Flat per-token indices: which row, which position.
        tok_row = np.repeat(rows, num_sched)
        positions = np.arange(total, dtype=np.int64) - np.repeat(qsl[:-1] - start, num_sched)
        input_ids = batch.token_ids[tok_row, positions]
        slot_mapping = batch.block_table[tok_row, positions // self.block_size].astype(np.int64) * self.block_size + (
            positions % self.block_size
        )
        max_blocks = int((seq_lens.max() + self.block_size - 1) // self.block_size)
        block_tables = batch.block_table[rows, :max_blocks]
        sample_mask = seq_lens == batch.num_tokens[rows]
        sample_idx = np.nonzero(sample_mask)[0]
        # After this step these tokens are computed (the scheduler sends the authoritative value).
        batch.num_computed_tokens[rows] = seq_lens
        dev = self.device
        meta = AttentionMetadata(
            num_actual_tokens=total,
            max_query_len=int(num_sched.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=_to_device(qsl.astype(np.int32), dev),
            seq_lens=_to_device(seq_lens.astype(np.int32), dev),
            block_tables=_to_device(np.ascontiguousarray(block_tables), dev),
            slot_mapping=_to_device(slot_mapping, dev),
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        return PreparedInputs(
            input_ids=_to_device(input_ids, dev),
            positions=_to_device(positions, dev),
            attn_metadata=meta,
            logits_indices=_to_device(qsl[1:][sample_idx] - 1, dev),
            req_ids=req_ids,
            sample_req_idx=sample_idx.tolist(),
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


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
