"""Builds the runner's proposer from ``speculative_config`` (speculative decoding's drafts).

The proposers themselves live in ``pagedllm/spec_decode/``; this module gives them what only the
worker has: the device, the dtype, the KV block count, and for a draft model its loaded weights,
its KV caches (sized with the target's: ``draft_bytes_per_block`` joins the target's per-block
bytes when the worker sizes the pool, and the draft gets as many blocks plus room for every
request's drafts) and ``DraftModelRunner``, which runs the draft's forwards through the same
input staging as the target's steps (``input_prep``) and, on CUDA, its own CUDA graphs.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.backend import AttentionBackend, CommonAttentionInputs, forward_context
from pagedllm.attention.registry import get_attention_backend
from pagedllm.config import EngineConfig
from pagedllm.layers.dispatch import prepare_model_kernels
from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.interface import Proposer
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.worker import kv_cache as kvc
from pagedllm.worker.cuda_graph import CUDAGraphRunner
from pagedllm.worker.device_inputs import DeviceInputs
from pagedllm.worker.input_prep import graph_shape, stage_tokens

# The draft's catch-up forward computes 1 or 2 tokens per request once a request's prompt is in
# (2 after every draft was accepted): its CUDA graphs take up to 2 queries per request.
_CATCH_UP_QUERY_LEN = 2


class DraftModelRunner:
    """``DraftSteps`` for ``DraftModelProposer``: stages a forward of the draft model's rows into its
    own ``DeviceInputs`` (one host->device copy), then replays the draft's CUDA graph of that shape
    (``capture_graphs``: decode graphs, and graphs of 2 queries per request) or runs it eagerly.

    Invariant: ``inputs.row_block_table[row]`` on the device equals the proposer's host block table
    row once a run has flushed the queued updates. Cost per run: O(tokens) numpy staging, one copy,
    the forward, the LM head on one row per request and an argmax; nothing waits for the device."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, device: torch.device, max_num_tokens: int,
                 max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.model = model
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.inputs = DeviceInputs(max_num_tokens, max_num_reqs, -(-max_model_len // block_size), device)
        self.graphs: CUDAGraphRunner | None = None

    def capture_graphs(self, allow_pdl: bool) -> float:
        """Capture the draft's decode graphs and its two-query graphs (CUDA). Returns seconds."""
        self.graphs = CUDAGraphRunner(self.model, self.backend, self.inputs, self.max_num_reqs, self.device,
                                      allow_pdl=allow_pdl, verify_query_len=_CATCH_UP_QUERY_LEN,
                                      max_num_tokens=self.max_num_tokens)
        return self.graphs.capture_all()

    def set_blocks(self, row: int, first_col: int, block_ids: list[int]) -> None:
        self.inputs.queue_block_update(row, first_col, block_ids)

    @torch.inference_mode()
    def run(self, token_ids: np.ndarray, block_table: np.ndarray, rows: np.ndarray, num_sched: np.ndarray,
            seq_lens: np.ndarray, last_token: torch.Tensor | None = None) -> torch.Tensor:
        num_reqs, total, max_query_len = len(rows), int(num_sched.sum()), int(num_sched.max())
        size, q = graph_shape(self.graphs, num_reqs, max_query_len, seq_lens)
        stage = self.inputs.begin_step(*((total, num_reqs) if size is None else (size * q, size)))
        first = stage_tokens(stage, token_ids, block_table, self.block_size, rows, num_sched, seq_lens, size, q)
        stage["logits_indices"][:num_reqs] = first + num_sched - 1  # each request's last token
        self.inputs.flush_block_updates()
        dev = self.inputs.copy_to_device()
        block_tables = self.inputs.gather_block_tables(dev["rows"], num_reqs if size is None else size)
        if last_token is not None:  # one token per request (decode), staged back to back
            dev["input_ids"][:num_reqs].copy_(last_token)
        last = dev["logits_indices"][:num_reqs]
        if size is not None:  # the graph reads the views just filled, block tables included
            return self.graphs.replay(size, q)[last].argmax(dim=-1)
        meta = self.backend.metadata_builder.build(CommonAttentionInputs(
            num_actual_tokens=total, max_query_len=max_query_len, query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"], block_tables=block_tables, slot_mapping=dev["slot_mapping"],
            query_start_loc_host=stage["query_start_loc"], seq_lens_host=stage["seq_lens"]))
        with forward_context(meta, self.backend):
            hidden = self.model(dev["input_ids"], dev["positions"])
        return self.model.compute_logits(hidden[last], upcast=False).argmax(dim=-1)


def load_draft_model(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> torch.nn.Module | None:
    """The draft model of method "draft_model", loaded and prepared for ``device``; else None."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    from pagedllm.models.registry import build_model, init_dummy_weights, load_model

    mc = spec.draft_model_config
    if mc.load_format == "dummy":
        model = init_dummy_weights(build_model(mc.hf_config, dtype, device), seed=mc.seed)
    else:
        model = load_model(mc.source, mc.hf_config, dtype, device)
    model.eval()
    prepare_model_kernels(model, device, config.kernel_config)
    return model


def draft_bytes_per_block(draft_model: torch.nn.Module | None, block_size: int, dtype: torch.dtype) -> int:
    """Bytes the draft's KV cache takes per target block (0 without a draft model)."""
    if draft_model is None:
        return 0
    numel = 1
    for d in draft_model.kv_cache_shape_per_layer(1, block_size):
        numel *= d
    return numel * torch.finfo(dtype).bits // 8 * draft_model.num_attention_layers


def build_proposer(config: EngineConfig, draft_model: torch.nn.Module | None, num_blocks: int,
                   device: torch.device, dtype: torch.dtype) -> Proposer | None:
    """The proposer ``speculative_config`` asks for (None without one); a draft model's KV caches
    are allocated here: ``num_blocks`` like the target's, plus enough for every request's drafts."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    block_size = config.cache_config.block_size
    sc = config.scheduler_config
    num_draft_blocks = num_blocks + sc.max_num_seqs * (-(-spec.num_speculative_tokens // block_size) + 1)
    shape = draft_model.kv_cache_shape_per_layer(num_draft_blocks, block_size)
    draft_model.bind_kv_caches(kvc.allocate_kv_caches(draft_model.num_attention_layers, shape, dtype, device))
    max_model_len = config.model_config.max_model_len
    runner = DraftModelRunner(draft_model, get_attention_backend(config.attention_backend, device), device,
                              max(sc.max_num_batched_tokens, _CATCH_UP_QUERY_LEN * sc.max_num_seqs), sc.max_num_seqs,
                              max_model_len, block_size)
    return DraftModelProposer(runner, device, spec.num_speculative_tokens, block_size, num_draft_blocks,
                              sc.max_num_seqs, max_model_len)
