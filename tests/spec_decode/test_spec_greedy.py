"""Greedy outputs are the same with and without speculative decoding (n-gram and draft model).

Tiny random models, 12 ragged requests in one engine (half share a 40-token prefix, later ones
join a running batch), with chunked prefill forced small and with preemption forced; the block
pool's integrity is checked after every step (``run_engine``). A draft model equal to the target
has every draft accepted.
"""

from __future__ import annotations

import pytest

from pagedllm import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from tests.engine.test_greedy_vs_transformers import make_prompts, run_engine
from tests.helpers import make_tiny_model

NUM_REQUESTS = 12
BASE = dict(max_model_len=256, max_num_seqs=16)
CONFIGS = {
    "default": BASE,
    "chunked_16": dict(BASE, max_num_batched_tokens=16, max_num_seqs=8),
    "preempt": dict(BASE, num_gpu_blocks_override=48, block_size=4),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = make_tiny_model("llama", tmp_path_factory.mktemp("target"))
    other = make_tiny_model("qwen3", tmp_path_factory.mktemp("draft"), seed=1)
    # Repeating prompts: the n-gram proposer finds its drafts in them.
    prompts, max_tokens = make_prompts(seed=3, n=NUM_REQUESTS, vocab=300)
    prompts = [p + p[: len(p) // 2] for p in prompts]
    max_tokens = [m + 30 for m in max_tokens]
    return target, other, prompts, max_tokens


@pytest.fixture(scope="module")
def plain(models):
    target, _, prompts, max_tokens = models
    return {name: run_engine(LLMEngine.from_engine_args(EngineArgs(model=target, **cfg)), prompts, max_tokens)
            for name, cfg in CONFIGS.items()}


def spec_engine(target: str, spec: dict, **kwargs) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=target, speculative_config=spec, **kwargs))


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_is_target"])
def test_greedy_outputs_equal_without_speculation(models, plain, config_name, method):
    target, other, prompts, max_tokens = models
    spec = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft_model": {"model": other, "num_speculative_tokens": 3},
        "draft_is_target": {"method": "draft_model", "model": target, "num_speculative_tokens": 4},
    }[method]
    engine = spec_engine(target, spec, **CONFIGS[config_name])
    ours = run_engine(engine, prompts, max_tokens)
    for i, (o, r) in enumerate(zip(ours, plain[config_name])):
        assert o == r, f"{method}/{config_name}/r{i}"
    scheduler = engine.engine_core.scheduler
    stats = scheduler.stats().spec_decoding
    assert stats is not None and stats.num_drafts > 0
    if method != "draft_model":  # an unrelated random draft is (nearly) always wrong
        assert stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos) <= stats.num_draft_tokens
    if method == "draft_is_target":
        assert stats.num_accepted_tokens == stats.num_draft_tokens, "a draft equal to the target is always right"
    if config_name == "preempt":
        assert scheduler.stats().num_preemptions_total > 0
    if config_name != "preempt":
        assert scheduler.stats().prefix_cache_hits > 0
    proposer = engine.engine_core.runner.proposer
    if method != "ngram":
        assert not proposer.kv.tables and len(proposer.kv.free) == proposer.kv.num_blocks, "draft blocks leaked"
