"""CUDA graphs per pipeline stage on ONE GPU: a pipeline of 2 stages of a tiny random Llama (both
workers in this process, the residual stream handed over in memory: ``pp_two_stage.py`` says why)
with captured decode graphs, against the same pipeline with ``enforce_eager`` and against the
single-stage engine: greedy ids equal (near-tie rule of tests/engine/reference.py), decode steps
replayed through each stage's own graphs with two micro-batches in flight. Skipped without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagedllm import EngineArgs, LLMEngine, SamplingParams
from tests.worker.pp_two_stage import make_pp_model, two_stage_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(600)]

ENGINE = dict(dtype="float32", skip_tokenizer_init=True, max_num_seqs=16, max_model_len=256,
              num_gpu_blocks_override=256, seed=0)
PROMPTS = [[(37 * i + 11 * j) % 1000 + 3 for j in range(6 + 7 * i)] for i in range(11)]
# Requests end one after another, so decode micro-batches shrink through the graph sizes 8 .. 1
# (the residual's pair form below 3 rows, the stream form from there on CUDA).
MAX_TOKENS = [8 + 3 * i for i in range(len(PROMPTS))]


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], ignore_eos=True)
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        engine.engine_core.scheduler.check_integrity()
    return outputs


def _count_replays(worker) -> list[tuple[int, int]]:
    """Wrap the worker's graph runner's ``replay_stage``; returns the list it appends (bs, tokens) to."""
    graphs, calls = worker.model_runner.graph_runner, []
    replay_stage = graphs.replay_stage

    def counted(bs, q, num_tokens):
        calls.append((bs, num_tokens))
        return replay_stage(bs, q, num_tokens)

    graphs.replay_stage = counted
    return calls


def _assert_same_up_to_near_ties(folder: str, ours: dict, ref: dict, label: str) -> None:
    if ours == ref:
        return
    from reference import assert_greedy_match
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for req_id in ref:
        assert_greedy_match(model, PROMPTS[int(req_id)], ours[req_id], ref[req_id], f"{label} request {req_id}")


def test_pp2_stage_graphs_on_one_gpu_equal_eager_and_single_stage(tmp_path):
    folder = make_pp_model(tmp_path / "tiny_llama_pp")
    single = LLMEngine.from_engine_args(EngineArgs(model=folder, **ENGINE))
    try:
        assert single.engine_core.runner.graph_runner is not None
        expected = _run(single)
    finally:
        single.shutdown()
    del single
    results = {}
    for eager in (False, True):
        engine = two_stage_engine(EngineArgs(model=folder, enforce_eager=eager, **ENGINE))
        try:
            stages = engine.engine_core.executor.stages
            if eager:
                assert all(w.model_runner.graph_runner is None for w in stages)
            else:
                graphs = [w.model_runner.graph_runner for w in stages]
                assert all(g is not None and g.graphs for g in graphs)
                assert graphs[0].intermediate is None and graphs[1].intermediate is not None
                replays = [_count_replays(w) for w in stages]
            results[eager] = _run(engine)
            assert engine.engine_core.micro_batch_stats["max_in_flight"] == 2
        finally:
            engine.shutdown()
        del engine
        torch.cuda.empty_cache()
    assert replays[0] == replays[1] and len(replays[1]) >= max(MAX_TOKENS)
    assert any(bs > n for bs, n in replays[1]), "no padded decode step"
    assert {bs for bs, _ in replays[1]} >= {1, 8}
    _assert_same_up_to_near_ties(folder, results[False], expected, "PP=2 graphs vs single stage")
    _assert_same_up_to_near_ties(folder, results[True], expected, "PP=2 eager vs single stage")
    _assert_same_up_to_near_ties(folder, results[False], results[True], "PP=2 graphs vs eager")
