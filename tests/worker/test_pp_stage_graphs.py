"""CUDA graphs per pipeline stage, checked on the CPU: each stage's graph plan (the decode sizes,
the static input buffer of a stage after the first, the output of each graph: residual stream or
logits) and, with the graphs replayed eagerly over their static buffers (``EagerStageReplay``),
a pipeline of 2 stages in one process (``pp_two_stage.py``) against the single-stage engine:
greedy ids equal with two micro-batches in flight, decode steps through ``replay_stage`` on both
stages, padded ones included. The same on CUDA with captured graphs: ``test_pp_stage_graphs_gpu.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedllm import EngineArgs, LLMEngine, SamplingParams
from pagedllm.engine.config_builder import create_engine_config
from pagedllm.worker.cuda_graph import CUDAGraphRunner, capture_sizes
from pagedllm.worker.worker import uses_decode_graphs
from tests.worker.pp_two_stage import EagerStageReplay, TwoStageExecutor, make_pp_model, two_stage_engine

pytestmark = pytest.mark.timeout(240)

MAX_NUM_SEQS = 8
ENGINE = dict(dtype="float32", skip_tokenizer_init=True, device="cpu", max_num_seqs=MAX_NUM_SEQS,
              max_model_len=128, num_gpu_blocks_override=64, seed=0)
PROMPTS = [[(37 * i + 11 * j) % 1000 + 3 for j in range(6 + 5 * i)] for i in range(7)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_pp_model(tmp_path_factory.mktemp("tiny_llama_pp_graphs"))


@pytest.fixture(scope="module")
def stages(folder):
    """The two stages' workers (no KV cache), built as the engine builds them."""
    config = create_engine_config(EngineArgs(model=folder, pipeline_parallel_size=2, **ENGINE))
    return TwoStageExecutor(config).stages


def test_every_stage_captures_graphs_when_pipeline_parallel(folder):
    """On CUDA every stage (not only a single one) decides to capture; never eager / pooling."""
    config = create_engine_config(EngineArgs(model=folder, pipeline_parallel_size=2, **ENGINE))
    config = dataclasses.replace(config, enforce_eager=False)  # as a CUDA config has it
    backend = type("Backend", (), {"supports_decode_graphs": True})()
    cuda = torch.device("cuda")
    assert uses_decode_graphs(config, cuda, backend)
    assert not uses_decode_graphs(config, torch.device("cpu"), backend)
    assert not uses_decode_graphs(dataclasses.replace(config, enforce_eager=True), cuda, backend)
    pooling = dataclasses.replace(config, model_config=dataclasses.replace(config.model_config, runner="pooling"))
    assert not uses_decode_graphs(pooling, cuda, backend)


def test_stage_graph_plan(stages):
    """Stage 0: the decode sizes and no input buffer. Stage 1: the same sizes and a [largest size,
    hidden] input buffer in the activations' dtype. (What each graph ends with is checked on the
    replays of the pipeline test below.)"""
    first, last = (EagerStageReplay(w) for w in stages)
    hidden = stages[0].model.config.hidden_size
    assert first.sizes == last.sizes == capture_sizes(MAX_NUM_SEQS) == [1, 2, 4, 8]
    assert first.token_counts == last.token_counts == [1, 2, 4, 8]
    assert first.intermediate is None
    assert last.intermediate.shape == (MAX_NUM_SEQS, hidden) and last.intermediate.dtype == torch.float32
    # A micro-batch takes at most ceil(unfinished / P) <= max_num_seqs requests: always a graph size.
    assert all(first.padded_size(n) is not None for n in range(1, MAX_NUM_SEQS + 1))


def test_a_stage_after_the_first_needs_the_dtype_and_has_no_verify_graphs(stages):
    w = stages[1]
    inputs = w.model_runner.prep.inputs
    with pytest.raises(ValueError, match="^dtype: "):
        CUDAGraphRunner(w.model, w.backend, inputs, MAX_NUM_SEQS, w.device, pp=w.model_runner.pp)
    with pytest.raises(ValueError, match="^verify_query_len: "):
        CUDAGraphRunner(w.model, w.backend, inputs, MAX_NUM_SEQS, w.device, verify_query_len=3, max_num_tokens=64,
                        pp=w.model_runner.pp, dtype=torch.float32)


def run(engine: LLMEngine, prompts, params) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        engine.engine_core.scheduler.check_integrity()
    return outputs


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_two_stages_with_stage_graphs_equal_the_single_stage_engine(arch, folder, tmp_path):
    if arch != "llama":  # Gemma's decoder hands its stream over in its own forward
        folder = make_pp_model(tmp_path / arch, arch)
    reference = LLMEngine.from_engine_args(EngineArgs(model=folder, **ENGINE))
    try:
        expected = run(reference, PROMPTS, GREEDY)
    finally:
        reference.shutdown()
    engine = two_stage_engine(EngineArgs(model=folder, **ENGINE))
    try:
        stages = engine.engine_core.executor.stages
        graphs = [EagerStageReplay(w) for w in stages]
        for w, g in zip(stages, graphs):
            w.model_runner.graph_runner = g
        got = run(engine, PROMPTS, GREEDY)
        assert engine.engine_core.micro_batch_stats["max_in_flight"] == 2
    finally:
        engine.shutdown()
    assert got == expected
    assert graphs[0].replays == graphs[1].replays  # every decode step replayed on both stages
    hidden, vocab = stages[0].model.config.hidden_size, stages[0].model.config.vocab_size
    # Stage 0's graphs end with the residual stream, stage 1's with the logits; padded rows too.
    assert graphs[0].output_shapes == {(bs, hidden) for bs, _ in graphs[0].replays}
    assert graphs[1].output_shapes == {(bs, vocab) for bs, _ in graphs[1].replays}
    assert any(bs > n for bs, n in graphs[1].replays), "no padded decode step"
    assert len(graphs[1].replays) >= GREEDY.max_tokens
