"""Greedy token ids equal transformers' generate(do_sample=False) in float32 on the CPU.

For tiny random Llama / Mistral / Qwen2 / Qwen3 checkpoints and the embedded SmolLM2: single
requests, and 34 ragged requests in one engine (half of them sharing a long prefix), with prefix
caching on and off, with a token budget small enough to chunk every prompt, and with a KV pool
small enough to force preemption. The block pool's integrity is checked after every step.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from tests.engine.reference import assert_greedy_match, hf_greedy
from tests.helpers import TINY_ARCHS, make_tiny_model

NUM_REQUESTS = 34


def make_prompts(seed: int, n: int, vocab: int = 49152) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts, max_tokens = [], []
    for i in range(n):
        own = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 50))]
        prompts.append(shared + own if i % 2 == 0 else own)
        max_tokens.append(rng.randint(4, 20))
    return prompts, max_tokens


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Add the first 4 prompts, then the rest after two steps (so later requests can hit the prefix
    cache and join a running batch); step until done, checking block-pool integrity every step."""

    def add(i: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True)
        engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params)

    for i in range(min(4, len(prompts))):
        add(i)
    results: dict[str, list[int]] = {}
    scheduler = engine.engine_core.scheduler
    for step in range(10_000):
        if step == 2:
            for i in range(4, len(prompts)):
                add(i)
        if step > 2 and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                assert out.outputs[0].finish_reason == "length"
                results[out.request_id] = out.outputs[0].token_ids
        scheduler.check_integrity()
    assert not engine.has_unfinished_requests()
    assert scheduler.block_pool.get_usage() == 0.0, "blocks still held after every request finished"
    return [results[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module", params=TINY_ARCHS)
def tiny(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts, max_tokens = make_prompts(seed=1, n=NUM_REQUESTS)
    refs = [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
    return request.param, folder, hf, prompts, max_tokens, refs


CONFIGS = {
    "default": dict(),
    "no_prefix_cache": dict(enable_prefix_caching=False),
    "chunked_16": dict(max_num_batched_tokens=16, max_num_seqs=8),
    "preempt": dict(num_gpu_blocks_override=40, block_size=4, max_num_seqs=16),
}


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_batch_matches_transformers(tiny, config_name):
    arch, folder, hf, prompts, max_tokens, refs = tiny
    engine = LLMEngine.from_engine_args(EngineArgs(model=folder, dtype="float32", **CONFIGS[config_name]))
    ours = run_engine(engine, prompts, max_tokens)
    for i, (o, r) in enumerate(zip(ours, refs)):
        assert_greedy_match(hf, prompts[i], o, r, f"{arch}/{config_name}/r{i}")
    stats = engine.engine_core.scheduler.stats()
    if config_name == "preempt":
        assert stats.num_preemptions_total > 0, "the small pool was meant to force preemption"
    if config_name in ("default", "chunked_16", "preempt"):
        assert stats.prefix_cache_hits > 0, "requests sharing a 40-token prefix should hit the cache"
    if config_name == "no_prefix_cache":
        assert stats.prefix_cache_hits == 0


def test_single_request_matches_transformers(tiny):
    arch, folder, hf, prompts, max_tokens, refs = tiny
    engine = LLMEngine.from_engine_args(EngineArgs(model=folder, dtype="float32"))
    for i in (0, 1):
        [ours] = run_engine(engine, [prompts[i]], [max_tokens[i]])
        assert_greedy_match(hf, prompts[i], ours, refs[i], f"{arch}/single/r{i}")


# -- the embedded SmolLM2 (GGUF) --------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm():
    import os

    from transformers import AutoModelForCausalLM

    from pagedllm.loader import default_model_path

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    return hf


@pytest.mark.slow
def test_smollm2_text_prompts_match_transformers(smollm):
    engine = LLMEngine.from_engine_args(EngineArgs(dtype="float32"))
    tok = engine.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    prompts = [tok.encode(t) for t in texts]
    refs = [hf_greedy(smollm, p, 12) for p in prompts]
    ours = run_engine(engine, prompts, [12] * len(prompts))
    for p, o, r, t in zip(prompts, ours, refs, texts):
        assert_greedy_match(smollm, p, o, r, f"smollm2/{t!r}")
    assert tok.decode(ours[0]).startswith(" Paris")


@pytest.fixture(scope="module")
def smollm_batch(smollm):
    prompts, max_tokens = make_prompts(seed=2, n=32)
    prompts = [p[:40] for p in prompts]
    max_tokens = [min(m, 10) for m in max_tokens]
    refs = [hf_greedy(smollm, p, m) for p, m in zip(prompts, max_tokens)]
    return prompts, max_tokens, refs


SMOLLM_CONFIGS = {
    # prefix caching on, every prompt chunked (16-token budget), a pool small enough to preempt
    "prefix_chunked_preempt": dict(max_num_batched_tokens=16, max_num_seqs=16, num_gpu_blocks_override=40, block_size=4),
    "no_prefix_cache": dict(enable_prefix_caching=False),
}


@pytest.mark.slow
@pytest.mark.parametrize("config_name", list(SMOLLM_CONFIGS))
def test_smollm2_batch_matches_transformers(smollm, smollm_batch, config_name):
    prompts, max_tokens, refs = smollm_batch
    engine = LLMEngine.from_engine_args(EngineArgs(dtype="float32", **SMOLLM_CONFIGS[config_name]))
    ours = run_engine(engine, prompts, max_tokens)
    for i, (o, r) in enumerate(zip(ours, refs)):
        assert_greedy_match(smollm, prompts[i], o, r, f"smollm2/{config_name}/r{i}")
    stats = engine.engine_core.scheduler.stats()
    if config_name == "prefix_chunked_preempt":
        assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0
    else:
        assert stats.prefix_cache_hits == 0
