"""timeout_s through the engine: a request held behind max_num_seqs=1 longer than timeout_s is
finished with finish_reason "abort" and stop_reason QUEUE_TIMEOUT_REASON, the others finish, and
the block pool stays whole after every step."""

from __future__ import annotations

import time

import pytest

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.outputs import QUEUE_TIMEOUT_REASON
from tests.helpers import make_tiny_model

TIMEOUT_S = 60.0  # far above how long the others wait, even on a busy machine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    return LLMEngine.from_engine_args(EngineArgs(model=folder, dtype="float32", max_model_len=256, max_num_seqs=1,
                                                 timeout_s=TIMEOUT_S))


def step_checked(engine: LLMEngine) -> list:
    outs = engine.step()
    engine.engine_core.scheduler.check_integrity()
    return outs


def test_a_request_held_behind_max_num_seqs_times_out(engine):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request("running", "Tell me a story", params)
    step_checked(engine)  # "running" takes the only slot
    # It arrived (the caller's arrival_time, as a front end passes it) longer ago than timeout_s.
    engine.add_request("held", "Hello", SamplingParams(max_tokens=4), arrival_time=time.time() - 1.2 * TIMEOUT_S)
    engine.add_request("fresh", "Hi", SamplingParams(max_tokens=3, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        for out in step_checked(engine):
            if out.finished:
                finished[out.request_id] = out
    held = finished["held"]
    assert [(c.finish_reason, c.stop_reason, c.token_ids) for c in held.outputs] == [
        ("abort", QUEUE_TIMEOUT_REASON, [])]
    assert held.metrics.first_scheduled_time is None and held.metrics.finished_time - held.metrics.arrival_time >= TIMEOUT_S
    assert len(finished["running"].outputs[0].token_ids) == 20
    assert finished["fresh"].outputs[0].finish_reason == "length"
    assert engine.engine_core.scheduler.block_pool.get_usage() == 0.0
