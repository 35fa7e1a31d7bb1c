"""The scheduler's side of pooling requests, with hand-made runner outputs: a pooling request is
scheduled over chunks like a prompt, finishes ("stop") when the runner returns its vector, frees
its blocks in that same update, and is never scheduled again (also with a step in flight)."""

from __future__ import annotations

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.pooling import POOLING_PLACEHOLDER_PARAMS
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import Request


def _scheduler(max_num_batched_tokens: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(4, max_num_batched_tokens, 64), CacheConfig(4, 32, False))


def _pooling_request(req_id: str, num_tokens: int) -> Request:
    return Request(req_id, list(range(1, num_tokens + 1)), POOLING_PLACEHOLDER_PARAMS, None, 0.0, 0, 1,
                   pooling_params=PoolingParams(normalize=True))


def _no_tokens(so) -> ModelRunnerOutput:
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[] for _ in ids])


def test_pooling_request_finishes_on_its_vector_and_frees_blocks_in_that_update():
    scheduler = _scheduler()
    free = scheduler.block_pool.get_num_free_blocks()
    scheduler.add_request(_pooling_request("p", 13))
    first = scheduler.schedule()
    assert first.scheduled_new_reqs[0].pooling_params == PoolingParams(normalize=True)
    assert first.num_scheduled_tokens == {"p": 8}
    assert scheduler.update_from_output(first, _no_tokens(first)) == []  # a chunk: nothing to report
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"p": 5}
    vector = object()  # opaque to the scheduler
    out = scheduler.update_from_output(second, ModelRunnerOutput(["p"], [[]], pooler_output={"p": vector}))
    assert [(o.req_id, o.finish_reason, o.new_token_ids, o.pooling_output) for o in out] == [("p", "stop", [], vector)]
    assert not scheduler.requests and scheduler.block_pool.get_num_free_blocks() == free
    scheduler.check_integrity()
    assert scheduler.schedule().finished_req_ids == {"p"}


def test_with_a_step_in_flight_a_pooled_prompt_is_not_scheduled_again():
    scheduler = _scheduler()
    scheduler.add_request(_pooling_request("p", 6))
    launched = scheduler.schedule()  # the whole prompt: the runner will pool it
    in_flight = scheduler.schedule()  # async scheduling: the next step is planned before the result
    assert in_flight.num_scheduled_tokens == {}
    scheduler.update_from_output(launched, ModelRunnerOutput(["p"], [[]], pooler_output={"p": 1}))
    scheduler.update_from_output(in_flight, _no_tokens(in_flight))
    assert not scheduler.requests
    scheduler.check_integrity()
