"""Async scheduling on the CPU: one step in flight, each sampled token forwarded to the next step
without the host (InputPreparer), and the host waiting only where StepSyncPolicy says so. The
tokens must be those of synchronous steps (the requests run side by side to the end, so both modes
batch the same tokens together)."""

from __future__ import annotations

import pytest

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.worker.input_prep import InputPreparer
from pagedllm.worker.sync_policy import StepSyncPolicy
from tests.helpers import make_tiny_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny"))


def run(model_path, async_scheduling: bool, penalised: str) -> tuple[dict[str, list[int]], LLMEngine]:
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_path, dtype="float32", skip_tokenizer_init=True,
                                                   async_scheduling=async_scheduling, max_num_seqs=4,
                                                   max_num_batched_tokens=32))
    prompts = {"a": list(range(5, 40)), "b": [7, 8, 9], "c": [3] * 20, "d": list(range(100, 111))}
    for req_id, prompt in prompts.items():
        penalty = 1.7 if req_id in penalised else 1.0  # reads its token history: the host waits
        engine.add_request(req_id, {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=9, ignore_eos=True, repetition_penalty=penalty))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    return outputs, engine


@pytest.mark.parametrize("penalised", ["", "bd"])
def test_async_steps_give_the_tokens_of_synchronous_steps(model_path, monkeypatch, penalised):
    expected, _ = run(model_path, False, penalised)
    seen = {"waits": 0, "forwarded": 0}
    must_wait, stage = StepSyncPolicy.must_wait, InputPreparer._stage_pending_tokens

    def counting_wait(self, *args):
        seen["waits"] += (waited := must_wait(self, *args))
        return waited

    def counting_stage(self, *args):
        n, in_order = stage(self, *args)
        seen["forwarded"] += n
        return n, in_order

    monkeypatch.setattr(StepSyncPolicy, "must_wait", counting_wait)
    monkeypatch.setattr(InputPreparer, "_stage_pending_tokens", counting_stage)
    got, engine = run(model_path, True, penalised)
    assert got == expected
    if penalised:  # every step has a row that reads its history: each waits, nothing is forwarded
        assert seen["waits"] > 0 and seen["forwarded"] == 0
    else:
        assert seen["waits"] == 0 and seen["forwarded"] > 0
