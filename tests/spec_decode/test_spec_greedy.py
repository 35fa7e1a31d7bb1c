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

pytestmark = pytest.mark.slow

NUM_REQUESTS = 12
BASE = dict(max_model_len=256, max_num_seqs=16)
CONFIGS = {
    "default": BASE,
    "chunked_16": dict(BASE, max_num_batched_tokens=16, max_num_seqs=8),
    "preempt": dict(BASE, num_gpu_blocks_override=48, block_size=4, max_num_batched_tokens=512),
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
    """The outputs without speculation, per (config, workload), computed when first asked for."""
    target, _, prompts, max_tokens = models
    cache = {}

    def get(config_name: str, short: bool) -> list[list[int]]:
        if (config_name, short) not in cache:
            engine = LLMEngine.from_engine_args(EngineArgs(model=target, **CONFIGS[config_name]))
            cache[config_name, short] = run_engine(engine, *workload(prompts, max_tokens, short))
        return cache[config_name, short]

    return get


def workload(prompts: list[list[int]], max_tokens: list[int], short: bool) -> tuple[list[list[int]], list[int]]:
    """The n-gram proposer needs long outputs (random models repeat themselves after a while); a
    draft model drafts every step, so a short workload shows it (a draft forward per token is slow
    on 2 CPU cores)."""
    if short:
        return [p[:60] for p in prompts], [m // 3 for m in max_tokens]
    return prompts, max_tokens


SPECS = {
    "ngram": lambda target, other: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                    "prompt_lookup_max": 3},
    "draft_model": lambda target, other: {"model": other, "num_speculative_tokens": 3},
    "draft_is_target": lambda target, other: {"method": "draft_model", "model": target, "num_speculative_tokens": 4},
}


@pytest.mark.parametrize("method, config_name", [
    ("ngram", "default"), ("ngram", "chunked_16"), ("ngram", "preempt"),
    ("draft_model", "default"), ("draft_is_target", "chunked_16"), ("draft_is_target", "preempt"),
])
def test_greedy_outputs_equal_without_speculation(models, plain, method, config_name):
    target, other, prompts, max_tokens = models
    short = method != "ngram"
    engine = LLMEngine.from_engine_args(EngineArgs(model=target, speculative_config=SPECS[method](target, other),
                                                   **CONFIGS[config_name]))
    ours = run_engine(engine, *workload(prompts, max_tokens, short))
    for i, (o, r) in enumerate(zip(ours, plain(config_name, short))):
        assert o == r, f"{method}/{config_name}/r{i}"
    scheduler = engine.engine_core.scheduler
    stats = scheduler.stats().spec_decoding
    assert stats is not None and stats.num_drafts > 0
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos) <= stats.num_draft_tokens
    if method == "ngram":
        assert stats.num_accepted_tokens > 0
    if method == "draft_is_target":
        assert stats.num_accepted_tokens == stats.num_draft_tokens, "a draft equal to the target is always right"
    if config_name == "preempt":
        assert scheduler.stats().num_preemptions_total > 0
    else:
        assert scheduler.stats().prefix_cache_hits > 0
    proposer = engine.engine_core.runner.proposer
    if method != "ngram":
        state = proposer.state
        assert not state.row_of and sorted(state.free_blocks) == list(range(state.num_blocks_total)), "draft blocks leaked"
