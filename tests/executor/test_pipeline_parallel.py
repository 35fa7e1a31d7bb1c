"""pipeline_parallel_size=2 (two CPU worker processes, gloo), and 2 x 2 with tensor parallel, on a
tiny random Qwen3 (2 decoder layers: one per stage; q/k norm, tied head) against the
single-process engine: greedy ids equal
under preemption, prefix caching and async scheduling, with the block pool intact after every step;
each stage holds only its own layers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import make_tiny_model, tiny_config  # noqa: E402
from test_multiproc import ENGINE, PROMPTS, run  # noqa: E402

from pagedllm import EngineArgs, LLMEngine, SamplingParams  # noqa: E402
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


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The tiny Qwen3 folder and the single-process engine's greedy outputs for PROMPTS."""
    folder = make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3_pp"))
    reference = LLMEngine.from_engine_args(EngineArgs(folder, **ENGINE))
    try:
        return folder, run(reference, PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    finally:
        reference.shutdown()


def test_pp2_greedy_equals_the_single_process_engine(qwen3):
    from test_multiproc import assert_equal_up_to_near_ties

    folder, expected = qwen3
    params = SamplingParams(temperature=0, max_tokens=24)
    # Async scheduling too: step N+1 is scheduled before N's ids come back from the last stage.
    engine = LLMEngine.from_engine_args(EngineArgs(folder, pipeline_parallel_size=2, async_scheduling=True, **ENGINE))
    try:
        ours = run(engine, PROMPTS, params)
        assert engine.engine_core.scheduler.num_preemptions_total > 0
        again = run(engine, PROMPTS[:3], params)  # the shared prefix now comes from the cache
    finally:
        engine.shutdown()
    assert_equal_up_to_near_ties(folder, ours, expected)
    assert_equal_up_to_near_ties(folder, again, {k: expected[k] for k in again})


def test_tp2_x_pp2_greedy_equals_the_single_process_engine(qwen3):
    from test_multiproc import assert_equal_up_to_near_ties

    folder, expected = qwen3
    engine = LLMEngine.from_engine_args(EngineArgs(folder, tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE))
    try:
        assert engine.engine_core.executor.output_rank == 2  # the last stage's first rank
        ours = run(engine, PROMPTS[:3], SamplingParams(temperature=0, max_tokens=24))
    finally:
        engine.shutdown()
    assert_equal_up_to_near_ties(folder, ours, {k: expected[k] for k in ours})
