"""Speculative decoding on CUDA (skipped without it): greedy outputs equal those without drafts,
with the decode CUDA graphs on for the plain steps and async scheduling on (the GPU defaults)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.helpers import has_default_model, make_tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_outputs_equal_on_cuda(tmp_path, method):
    target = make_tiny_model("llama", tmp_path / "t")
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
            if method == "ngram" else {"method": "draft_model", "model": target, "num_speculative_tokens": 3})
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8, 5 + i, 6, 7] * (1 + i % 3)} for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = {}
    for name, config in (("plain", None), ("spec", spec)):
        llm = LLM(target, dtype="float32", max_model_len=256, max_num_seqs=8, gpu_memory_utilization=0.3,
                  speculative_config=config)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.llm_engine.engine_core.scheduler.stats().spec_decoding
        llm.llm_engine.shutdown()
    assert outs["spec"] == outs["plain"]
    assert stats is not None and stats.num_accepted_tokens > 0


def _record_replays(graphs) -> list[int]:
    """Wrap ``graphs.replay`` to record the query length of every replay."""
    replayed, replay = [], graphs.replay

    def recording(bs: int, q: int = 1):
        replayed.append(q)
        return replay(bs, q)

    graphs.replay = recording
    return replayed


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


@pytest.mark.parametrize("num_speculative_tokens", [3, 5])
def test_verify_graphs_match_eager_verification(tmp_path, num_speculative_tokens):
    """Verification in the captured verify graphs (1 + k queries per request, padded) gives the
    eager engine's greedy tokens, logprobs within float tolerance, and does run in those graphs."""
    target = make_tiny_model("llama", tmp_path / "t")
    spec = {"method": "ngram", "num_speculative_tokens": num_speculative_tokens, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8, 5 + i, 6, 7] * (2 + i % 3)} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1)
    results = {}
    for eager in (True, False):
        llm = LLM(target, dtype="float32", max_model_len=256, max_num_seqs=8, gpu_memory_utilization=0.3,
                  speculative_config=spec, enforce_eager=eager)
        graphs = llm.llm_engine.engine_core.runner.graph_runner
        replayed = []
        if graphs is not None:
            assert graphs.verify_query_len == 1 + num_speculative_tokens and graphs.max_verify_size >= 8
            replayed = _record_replays(graphs)
        results[eager] = _run(llm, prompts, params)
        llm.llm_engine.shutdown()
        if not eager:
            assert 1 + num_speculative_tokens in replayed, "no step verified in a verify graph"
    (eager_ids, eager_lps), (graph_ids, graph_lps) = results[True], results[False]
    assert graph_ids == eager_ids
    for lps_e, lps_g, ids in zip(eager_lps, graph_lps, eager_ids):
        for e, g, t in zip(lps_e, lps_g, ids):
            assert abs(e[t].logprob - g[t].logprob) < 1e-3


def test_draft_model_runs_its_steps_in_its_decode_graphs(tmp_path):
    """The draft model's k - 1 single-token steps replay its own decode graphs (and its catch-up
    forward its verify-shaped graphs); outputs equal the eager engine's."""
    target = make_tiny_model("llama", tmp_path / "t")
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8] * (1 + i % 3)} for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(target, dtype="float32", max_model_len=256, max_num_seqs=8, gpu_memory_utilization=0.3,
                  speculative_config=spec, enforce_eager=eager)
        draft = llm.llm_engine.engine_core.runner.proposer.runner
        assert (draft.graphs is None) == eager
        replayed = _record_replays(draft.graphs) if draft.graphs is not None else []
        outs[eager] = _run(llm, prompts, params)[0]
        stats = llm.llm_engine.engine_core.scheduler.stats().spec_decoding
        llm.llm_engine.shutdown()
        assert stats.num_accepted_tokens == stats.num_draft_tokens  # the draft is the target
        if not eager:
            assert 1 in replayed
    assert outs[False] == outs[True]


@pytest.mark.skipif(not has_default_model(), reason="embedded SmolLM2 not installed")
def test_gguf_copy_workload_gives_the_same_greedy_text_on_cuda():
    """Real weights in the GPU's default dtype (the GGUF blocks packed, the Triton GGUF kernels):
    greedy n-gram speculation (verify graphs, the short-query attention kernel) gives the plain
    engine's tokens on a prompt that makes the model copy a passage, with most drafts accepted."""
    words = ("the river runs past the old mill where the miller counts the sacks of grain while "
             "children watch the ducks and the wheel turns slowly in the cold water").split()
    passage = " ".join(words[i * 7 % len(words)] for i in range(300))
    prompt = f"{passage}\n\n{passage[:80]}"
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    outs, stats = {}, None
    for name, config in (("plain", None), ("ngram", spec)):
        llm = LLM(max_model_len=1024, max_num_seqs=4, gpu_memory_utilization=0.3, speculative_config=config)
        outs[name] = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        if config is not None:
            stats = llm.llm_engine.engine_core.scheduler.stats().spec_decoding
        llm.llm_engine.shutdown()
    assert outs["ngram"] == outs["plain"]
    assert stats.mean_acceptance_length > 3.0
