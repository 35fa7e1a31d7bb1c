"""pipeline_parallel_size=2 (two CPU worker processes, gloo), and 2 x 2 with tensor parallel, on a
tiny random Qwen3 (2 decoder layers: one per stage; q/k norm, tied head) against the
single-process engine: greedy ids equal with two micro-batches in flight (the engine core's batch
queue), under preemption, prefix caching, aborts, async scheduling and structured output (with
jump-forward), with the block pool intact after every step; each stage holds only its own layers;
what pipeline parallelism cannot serve is refused at start-up."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import make_tiny_model, tiny_config  # noqa: E402
from test_multiproc import ENGINE, PROMPTS, run  # noqa: E402

from pagedllm import EngineArgs, LLMEngine, SamplingParams, StructuredOutputsParams  # noqa: E402
from pagedllm.distributed import PipelineParallelGroup, set_pp_group  # noqa: E402
from pagedllm.models.llama import LlamaForCausalLM, OtherStageLayer  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def test_each_stage_builds_only_its_layers():
    cfg = tiny_config("llama")
    cfg.num_hidden_layers = 4
    previous = set_pp_group(PipelineParallelGroup(stage=1, size=2, world_rank=1, tp_size=1))
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
    finally:
        set_pp_group(previous)
    assert [isinstance(layer, OtherStageLayer) for layer in model.model.layers] == [True, True, False, False]
    assert model.num_attention_layers == 2
    assert {n.split(".")[2] for n, _ in model.named_parameters() if n.startswith("model.layers.")} == {"2", "3"}


GREEDY = SamplingParams(temperature=0, max_tokens=24)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The tiny Qwen3 folder and the single-process engine's greedy outputs for PROMPTS."""
    folder = make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3_pp"))
    reference = LLMEngine.from_engine_args(EngineArgs(folder, **ENGINE))
    try:
        return folder, run(reference, PROMPTS, GREEDY)
    finally:
        reference.shutdown()


@pytest.fixture(scope="module")
def pp_engine(qwen3):
    """PP=2 with async scheduling (the last stage sends a step's ids only once the next step is
    launched, or on the driver's flush), prompts chunked by a 48-token budget, and jump-forward for
    constrained requests."""
    engine = LLMEngine.from_engine_args(EngineArgs(qwen3[0], pipeline_parallel_size=2, async_scheduling=True,
                                                   structured_outputs_jump_forward=True, max_num_batched_tokens=48,
                                                   **ENGINE))
    yield engine
    engine.shutdown()


def assert_all_blocks_free(engine: LLMEngine) -> None:
    pool = engine.engine_core.scheduler.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert not engine.engine_core.scheduler.num_in_flight


def test_pp2_greedy_equals_the_single_process_engine_with_micro_batches(qwen3, pp_engine):
    from test_multiproc import assert_equal_up_to_near_ties

    folder, expected = qwen3
    core = pp_engine.engine_core
    ours = run(pp_engine, PROMPTS, GREEDY)
    assert core.scheduler.num_preemptions_total > 0
    stats = dict(core.micro_batch_stats)
    assert stats["max_in_flight"] == 2 and stats["launched_behind_another"] > stats["launched"] // 3, stats
    assert_all_blocks_free(pp_engine)
    again = run(pp_engine, PROMPTS[:3], GREEDY)  # the shared prefix now comes from the cache
    assert_equal_up_to_near_ties(folder, ours, expected)
    assert_equal_up_to_near_ties(folder, again, {k: expected[k] for k in again})


def test_pp2_aborts_mid_run_keep_the_others_exact_and_free_every_block(qwen3, pp_engine):
    from test_multiproc import assert_equal_up_to_near_ties

    folder, expected = qwen3
    ours = run(pp_engine, PROMPTS, GREEDY, abort_at={"3": 2, "5": 5, "6": 9})
    assert set(ours) == set(expected)  # the aborted ones too (finish_reason "abort")
    aborted = {k: ours.pop(k) for k in ("3", "5", "6")}
    assert all(len(ids) < 24 for ids in aborted.values())
    assert not pp_engine.has_unfinished_requests()
    assert_all_blocks_free(pp_engine)
    assert_equal_up_to_near_ties(folder, ours, {k: expected[k] for k in ours})


def test_pp2_seeded_sampling_equals_the_single_process_engine(qwen3, pp_engine):
    params = SamplingParams(temperature=1.0, top_k=50, seed=123, max_tokens=8)
    reference = LLMEngine.from_engine_args(EngineArgs(qwen3[0], **ENGINE))
    try:
        expected = run(reference, PROMPTS[:4], params)
    finally:
        reference.shutdown()
    assert run(pp_engine, PROMPTS[:4], params) == expected


def test_pp2_structured_output_with_jump_forward_equals_the_single_process_engine(qwen3, pp_engine):
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    reference = LLMEngine.from_engine_args(EngineArgs(qwen3[0], structured_outputs_jump_forward=True, **ENGINE))
    try:
        expected = run(reference, PROMPTS[:4], params)
    finally:
        reference.shutdown()
    assert run(pp_engine, PROMPTS[:4], params) == expected
    assert pp_engine.engine_core.structured_output.num_jumped_tokens > 0
    assert_all_blocks_free(pp_engine)


def test_tp2_x_pp2_greedy_equals_the_single_process_engine(qwen3):
    from test_multiproc import assert_equal_up_to_near_ties

    folder, expected = qwen3
    engine = LLMEngine.from_engine_args(EngineArgs(folder, tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE))
    try:
        assert engine.engine_core.executor.output_rank == 2  # the last stage's first rank
        ours = run(engine, PROMPTS[:4], GREEDY)
        assert engine.engine_core.micro_batch_stats["max_in_flight"] == 2
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()
    assert_equal_up_to_near_ties(folder, ours, {k: expected[k] for k in ours})


def test_pooling_runner_with_pipeline_parallel_is_refused(qwen3):
    with pytest.raises(ValueError, match=r"^pipeline_parallel_size must be 1 with runner='pooling'"):
        LLMEngine.from_engine_args(EngineArgs(qwen3[0], runner="pooling", pipeline_parallel_size=2, **ENGINE))
