"""The scheduler's micro-batches (pipeline parallel): up to ``depth`` steps in flight over disjoint
requests, each a fair share, with the output tokens a step computes sent in
``SchedulerOutput.new_token_ids``; driven by test_scheduler's fake runner in the engine core's
batch-queue order (a step is applied only once ``depth`` are in flight or nothing is left to
schedule). A fake "first stage" learns tokens only from the scheduler outputs, as a pipeline stage
before the last does, and must always hold the tokens it computes."""

from __future__ import annotations

import random
import sys
from collections import deque
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_scheduler import FakeRunner, expected_tokens, make_request, setup  # noqa: E402

from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput  # noqa: E402
from pagedllm.request import RequestStatus  # noqa: E402


class FirstStage:
    """The tokens a pipeline stage before the last knows: prompts and resumed outputs from
    ``scheduled_new_reqs``, everything else from ``new_token_ids``."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def apply(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.tokens.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = new.prompt_token_ids + new.output_token_ids
        for cached in out.scheduled_cached_reqs:
            ids = out.new_token_ids.get(cached.req_id, [])
            end = cached.num_computed_tokens + out.num_scheduled_tokens[cached.req_id]
            known = self.tokens[cached.req_id]
            known[end - len(ids) : end] = ids
            assert len(known) >= end, f"{cached.req_id}: a stage before the last lacks a token it computes"

    def check(self, out: SchedulerOutput, runner: FakeRunner) -> None:
        """Every token the step computes is known here and equals the sampled one."""
        starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        starts.update({c.req_id: c.num_computed_tokens for c in out.scheduled_cached_reqs})
        for req_id, n in out.num_scheduled_tokens.items():
            start = starts[req_id]
            assert self.tokens[req_id][start : start + n] == runner.state[req_id].token_ids[start : start + n]


def run_pipelined(scheduler, runner: FakeRunner, depth: int, abort_at: dict[str, int] | None = None,
                  max_steps: int = 10_000) -> tuple[dict[str, list[int]], int]:
    """Drive the scheduler as the engine core's batch queue does; returns each finished request's
    tokens and how many steps were launched while another was in flight."""
    scheduler.schedule_micro_batches(depth)
    stage, queue = FirstStage(), deque()
    results: dict[str, list[int]] = {}
    overlapped = 0

    def apply(out, runner_out) -> None:
        for o in scheduler.update_from_output(out, runner_out):
            results.setdefault(o.req_id, []).extend(o.new_token_ids)
        scheduler.check_integrity()

    for step in range(max_steps):
        if not (scheduler.has_unfinished_requests() or queue or scheduler.has_finished_requests()):
            break
        for req_id, at in (abort_at or {}).items():
            if at == step:
                scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        launched = False
        if len(queue) < depth:
            out = scheduler.schedule()
            scheduler.check_integrity()
            for earlier, _ in queue:
                assert not set(earlier.num_scheduled_tokens) & set(out.num_scheduled_tokens), "not disjoint"
            if out.is_empty and not (out.finished_req_ids or out.preempted_req_ids):
                apply(out, ModelRunnerOutput([], []))
            else:
                stage.apply(out)
                queue.append((out, runner.execute(out)))
                stage.check(out, runner)
                launched = not out.is_empty
                overlapped += launched and len(queue) > 1
        if queue and (not launched or len(queue) == depth):
            apply(*queue.popleft())
    assert not scheduler.has_unfinished_requests() and not queue, "did not finish"
    assert scheduler.num_in_flight == 0
    assert scheduler.block_pool.get_num_free_blocks() == scheduler.block_pool.num_blocks, "leaked blocks"
    return results, overlapped


def test_micro_batches_are_disjoint_fair_shares_and_carry_the_sampled_tokens():
    scheduler, runner = setup(num_blocks=200, max_num_seqs=8, max_num_batched_tokens=256)
    for i in range(8):
        scheduler.add_request(make_request(f"r{i}", 6, max_tokens=4))
    scheduler.schedule_micro_batches(2)
    first, second = scheduler.schedule(), scheduler.schedule()
    assert len(first.num_scheduled_tokens) == len(second.num_scheduled_tokens) == 4
    assert not set(first.num_scheduled_tokens) & set(second.num_scheduled_tokens)
    assert scheduler.schedule().is_empty  # every request is in flight
    scheduler.update_from_output(first, runner.execute(first))
    third = scheduler.schedule()
    assert set(third.num_scheduled_tokens) == set(first.num_scheduled_tokens)
    for req_id in third.num_scheduled_tokens:  # each decodes the token the first step sampled
        assert third.new_token_ids[req_id] == [scheduler.requests[req_id].output_token_ids[-1]]


def test_no_new_token_ids_without_micro_batches():
    scheduler, runner = setup()
    scheduler.add_request(make_request("a", 6, max_tokens=3))
    for _ in range(3):
        out = scheduler.schedule()
        assert out.new_token_ids == {}
        scheduler.update_from_output(out, runner.execute(out))


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_pipelined_outputs_are_exact_under_preemption_chunking_and_aborts(depth):
    # 24 blocks of 4 tokens for 12 requests of up to 40 tokens: requests are preempted, some while
    # their micro-batch is in flight; a 16-token budget chunks the prompts.
    scheduler, runner = setup(num_blocks=24, max_num_seqs=6, max_num_batched_tokens=16)
    rng = random.Random(depth)
    reqs = [make_request(f"r{i}", rng.randint(3, 30), max_tokens=rng.randint(1, 10)) for i in range(12)]
    for r in reqs:
        scheduler.add_request(r)
    results, overlapped = run_pipelined(scheduler, runner, depth, abort_at={"r2": 3, "r7": 9})
    assert scheduler.num_preemptions_total > 0
    assert (overlapped > 0) == (depth > 1)
    for r in reqs:
        if r.request_id not in ("r2", "r7"):
            assert results[r.request_id] == expected_tokens(r.prompt_token_ids, r.max_tokens), r.request_id


def test_a_request_preempted_in_flight_waits_for_its_step():
    # b (higher priority) and a, one micro-batch each. b's second step needs a third block, which
    # only preempting a (the back of the running queue, in flight) frees; then b finishes and frees
    # the pool. a is re-admitted only after its own step is applied (with three or more
    # micro-batches in flight that comes later), and that stale result is dropped.
    scheduler, runner = setup(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    a, b = make_request("a", 8, max_tokens=8), make_request("b", 8, max_tokens=2, priority=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    scheduler.schedule_micro_batches(3)
    first, second = scheduler.schedule(), scheduler.schedule()
    assert list(first.num_scheduled_tokens) == ["b"] and list(second.num_scheduled_tokens) == ["a"]
    result_b, result_a = runner.execute(first), runner.execute(second)
    scheduler.update_from_output(first, result_b)
    third = scheduler.schedule()  # b needs a third block: a, in flight, is preempted
    assert list(third.num_scheduled_tokens) == ["b"] and third.preempted_req_ids == {"a"}
    assert a.status == RequestStatus.PREEMPTED
    scheduler.update_from_output(third, runner.execute(third))  # b finishes: every block is free
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert scheduler.schedule().num_scheduled_tokens == {}  # a fits, but its step is in flight
    assert scheduler.update_from_output(second, result_a) == []  # the stale result is dropped
    scheduler.check_integrity()
    assert a.output_token_ids == [] and scheduler.num_in_flight == 0
    assert list(scheduler.schedule().num_scheduled_tokens) == ["a"]
