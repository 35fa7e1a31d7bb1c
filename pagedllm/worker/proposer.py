"""Builds the runner's proposer from ``speculative_config`` (speculative decoding's drafts).

The proposers themselves live in ``pagedllm/spec_decode/``; this module gives them what only the
worker has: the device, the dtype, the KV block count, and for a draft model its loaded weights
and KV caches (sized with the target's: ``draft_bytes_per_block`` joins the target's per-block
bytes when the worker sizes the pool, and the draft gets as many blocks plus room for every
request's drafts).
"""

from __future__ import annotations

import torch

from pagedllm.attention.registry import get_attention_backend
from pagedllm.config import EngineConfig
from pagedllm.layers.dispatch import prepare_model_kernels
from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.interface import Proposer
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.worker import kv_cache as kvc


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
    return DraftModelProposer(draft_model, get_attention_backend(config.attention_backend, device), device,
                              spec.num_speculative_tokens, block_size, num_draft_blocks,
                              config.model_config.max_model_len)
