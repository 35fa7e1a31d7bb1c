"""Gemma 2, Gemma 3 (text), Phi-3 and sliding-window Mistral against transformers (CPU, float32).

Tiny random checkpoints (``tests/helpers.FAMILY_ARCHS``: attention and final soft caps, windows of 6
and 8 tokens far below the prompts, interleaved local/global layers with per-type RoPE, q/k norms,
sandwich norms, fused Phi-3 projections with longrope). Greedy ids of a ragged batch must equal
``generate(do_sample=False)`` of transformers' eager attention (SDPA would drop Gemma 2's soft cap),
with prefix caching, a token budget that chunks every prompt, and a pool small enough to preempt;
block-pool integrity is checked after every step. Mistral's sliding KV freeing keeps a long
request's blocks bounded by its window.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.loader.architectures import kv_sliding_window, layer_sliding_windows
from pagedllm.models import get_model_class
from tests.engine.reference import assert_greedy_match, hf_greedy
from tests.engine.test_greedy_vs_transformers import make_prompts, run_engine
from tests.helpers import FAMILY_ARCHS, make_tiny_model, tiny_config

NUM_REQUESTS = 8


@pytest.fixture(scope="module", params=FAMILY_ARCHS)
def family(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    prompts, max_tokens = make_prompts(seed=3, n=NUM_REQUESTS)
    max_tokens = [min(m, 12) for m in max_tokens]
    prompts = [p if len(p) > 17 else p + p[:1] * (18 - len(p)) for p in prompts]  # past Phi-3's original 16
    refs = [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
    return request.param, folder, hf, prompts, max_tokens, refs


CONFIGS = {
    "default": dict(),
    "chunked_16_preempt": dict(max_num_batched_tokens=16, max_num_seqs=8, num_gpu_blocks_override=48, block_size=4),
}


@pytest.mark.slow
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_batch_matches_transformers(family, config_name):
    arch, folder, hf, prompts, max_tokens, refs = family
    config = dict(CONFIGS[config_name])
    if arch == "mistral_sliding" and "num_gpu_blocks_override" in config:
        # It gives blocks back as its windows move: a pool just above the longest request, a larger
        # budget so that more requests run at once (the scheduler refuses a request longer than the pool).
        config.update(num_gpu_blocks_override=28, max_num_batched_tokens=48, max_num_seqs=10)
    engine = LLMEngine.from_engine_args(EngineArgs(model=folder, dtype="float32", **config))
    ours = run_engine(engine, prompts, max_tokens)
    for i, (o, r) in enumerate(zip(ours, refs)):
        assert_greedy_match(hf, prompts[i], o, r, f"{arch}/{config_name}/r{i}")
    stats = engine.engine_core.scheduler.stats()
    assert stats.prefix_cache_hits > 0, "requests sharing a 40-token prefix should hit the cache"
    if config_name == "chunked_16_preempt":
        assert stats.num_preemptions_total > 0, "the small pool was meant to force preemption"
    # Prompts longer than the window: the engine no longer caps max_model_len to it.
    assert engine.engine_core.scheduler.scheduler_config.max_model_len == tiny_config(arch).max_position_embeddings


def test_layer_windows_and_kv_freeing_follow_the_config():
    gemma2, gemma3, mistral = (tiny_config(a) for a in ("gemma2", "gemma3_text", "mistral_sliding"))
    assert layer_sliding_windows(gemma2) == [6, None, 6, None]
    assert layer_sliding_windows(gemma3) == [6, None, 6, None]
    assert layer_sliding_windows(mistral) == [8, 8, 8]
    assert kv_sliding_window(mistral) == 8
    assert kv_sliding_window(gemma2) is None and kv_sliding_window(gemma3) is None  # interleaved: keep all
    assert kv_sliding_window(tiny_config("phi3")) is None  # no window in this config
    for arch in ("gemma2", "gemma3_text", "phi3"):
        cfg = tiny_config(arch)
        cfg.architectures = [{"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                              "phi3": "Phi3ForCausalLM"}[arch]]
        assert get_model_class(cfg).__name__ == cfg.architectures[0]


def test_gemma_refuses_what_it_does_not_implement():
    from pagedllm.models import build_model

    cfg = tiny_config("gemma2")
    cfg.hidden_activation = "relu"
    with pytest.raises(ValueError, match="hidden_activation"):
        build_model(cfg, torch.float32, "cpu")
    cfg = tiny_config("gemma3_text")
    cfg.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        build_model(cfg, torch.float32, "cpu")


def test_sliding_kv_freeing_bounds_a_long_request(tmp_path):
    """A Mistral request of 200 tokens (50 blocks of 4) with a window of 8 holds at most
    cdiv(8, 4) + 2 real blocks at a decode step (the window's, the block being filled, one of
    slack) once it has needed a block past its prompt, and cdiv(8 + 32, 4) + 1 while its prompt goes
    in 32-token chunks (and until then), gives the rest back to
    the pool, and still matches transformers; the pool is whole after."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model("mistral_sliding", tmp_path / "m")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    prompt = make_prompts(seed=5, n=1)[0][0] * 4
    prompt = prompt[:150]
    ref = hf_greedy(hf, prompt, 50)
    engine = LLMEngine.from_engine_args(EngineArgs(model=folder, dtype="float32", block_size=4,
                                                   max_num_batched_tokens=32, num_gpu_blocks_override=64))
    scheduler = engine.engine_core.scheduler
    kv = scheduler.kv_cache_manager
    assert kv.sliding_window == 8
    engine.add_request("long", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    most_held = {"prefill": 0, "decode": 0}
    ours = None
    while engine.has_unfinished_requests():
        request = scheduler.get_request("long")
        # Blocks are given back when the request next needs one: from one block past the prompt on.
        phase = "decode" if request is None or request.num_computed_tokens >= len(prompt) + 4 else "prefill"
        for out in engine.step():
            if out.finished:
                ours = out.outputs[0].token_ids
        scheduler.check_integrity()
        if "long" in kv.req_to_blocks:
            held = kv.req_to_blocks["long"][kv.num_null_blocks["long"]:]
            most_held[phase] = max(most_held[phase], len(held))
            assert kv.block_pool.num_blocks - kv.get_num_free_blocks() == len(held)
    assert 0 < most_held["decode"] <= 8 // 4 + 2, most_held
    assert most_held["prefill"] <= (8 + 32) // 4 + 1, most_held
    assert_greedy_match(hf, prompt, ours, ref, "mistral_sliding/long")
    assert kv.get_num_free_blocks() == kv.num_blocks


def test_longrope_factors_are_fixed_by_the_model_context():
    """Long factors when max_position_embeddings exceeds the original context (vLLM's rule at its
    default max_model_len), else the short ones; HF's own functions compute both."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pagedllm.layers.rotary import compute_inv_freq

    cfg = tiny_config("phi3")
    long_ref, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, None, seq_len=17)
    assert torch.equal(compute_inv_freq(cfg, 16)[0], long_ref.float())
    cfg.max_position_embeddings = 16
    short_ref, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, None)
    assert torch.equal(compute_inv_freq(cfg, 16)[0], short_ref.float())
    assert not torch.equal(long_ref, short_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_triton_path_matches_transformers_on_gpu(arch, tmp_path):
    """The same tiny checkpoints on CUDA in float32 (Triton attention with the window and soft cap
    as compile-time constants, fused RoPE + K/V store, CUDA graphs): greedy ids equal transformers'."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(arch, tmp_path / arch)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    prompts, max_tokens = make_prompts(seed=4, n=6)
    prompts = [p if len(p) > 17 else p + p[:1] * (18 - len(p)) for p in prompts]
    refs = [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
    engine = LLMEngine.from_engine_args(EngineArgs(model=folder, dtype="float32", device="cuda", block_size=16,
                                                   num_gpu_blocks_override=256))
    ours = run_engine(engine, prompts, max_tokens)
    for i, (o, r) in enumerate(zip(ours, refs)):
        assert_greedy_match(hf, prompts[i], o, r, f"{arch}/cuda/r{i}")
