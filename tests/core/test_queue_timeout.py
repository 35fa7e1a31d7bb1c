"""timeout_s in the scheduler: a request never scheduled within timeout_s of its arrival is finished
as aborted (stop reason QUEUE_TIMEOUT_REASON) at the start of a schedule(), holding no blocks; a
request that was scheduled once never times out. Driven by a minimal fake runner (one token per
request that has computed all its tokens)."""

from __future__ import annotations

import time

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.outputs import QUEUE_TIMEOUT_REASON
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

TIMEOUT_S = 0.2


def make_scheduler(max_num_seqs: int = 1) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, 64, 512, True, "fcfs", timeout_s=TIMEOUT_S),
                     CacheConfig(4, 64, True))


def request(req_id: str, max_tokens: int = 50, arrival_time: float | None = None, prompt_len: int = 9) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id, list(range(1, prompt_len + 1)), params, eos_token_id=None, arrival_time=arrival_time)


def step(sched: Scheduler) -> dict[str, tuple]:
    """One schedule + update; {request id: (finish_reason, stop_reason)} of the finished."""
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[5] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else [] for r in ids]
    finished = {o.req_id: (o.finish_reason, o.stop_reason)
                for o in sched.update_from_output(out, ModelRunnerOutput(ids, sampled)) if o.finished}
    sched.check_integrity()
    return finished


def test_a_request_waiting_past_timeout_s_is_aborted_and_the_others_run():
    sched = make_scheduler()
    sched.add_request(request("running", max_tokens=30))
    step(sched)  # "running" holds the only slot
    sched.add_request(request("late", arrival_time=time.time() - 2 * TIMEOUT_S))
    sched.add_request(request("fresh", max_tokens=3))
    assert step(sched) == {"late": ("abort", QUEUE_TIMEOUT_REASON)}
    assert sched.get_request("late") is None and "fresh" in sched.requests
    finished = {}
    while sched.has_unfinished_requests():
        finished.update(step(sched))
    assert finished == {"running": ("length", None), "fresh": ("length", None)}
    assert sched.block_pool.get_usage() == 0.0


def test_a_request_scheduled_once_never_times_out():
    sched = make_scheduler()
    sched.add_request(request("a", max_tokens=8))
    step(sched)
    time.sleep(TIMEOUT_S * 1.5)  # "a" was scheduled: its wait is over
    finished = {}
    while sched.has_unfinished_requests():
        finished.update(step(sched))
    assert finished == {"a": ("length", None)}


def test_siblings_of_a_timed_out_first_sequence_time_out_with_it():
    """An n > 1 request whose first sequence (holding its siblings back) never ran: all time out."""
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(request("running", max_tokens=30))
    step(sched)
    old = time.time() - 2 * TIMEOUT_S
    # A prompt longer than a block: the siblings are held until the first has computed it.
    first, *siblings = [request(f"{i}_group", arrival_time=old, prompt_len=19) for i in range(3)]
    sched.add_request(first, siblings)
    assert sched._held_siblings
    assert step(sched) == {f"{i}_group": ("abort", QUEUE_TIMEOUT_REASON) for i in range(3)}
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.block_pool.get_usage() == 0.0


def test_without_timeout_s_requests_wait_as_long_as_it_takes():
    sched = Scheduler(SchedulerConfig(1, 64, 512, True, "fcfs"), CacheConfig(4, 64, True))
    sched.add_request(request("running", max_tokens=5))
    step(sched)
    sched.add_request(request("old", max_tokens=2, arrival_time=time.time() - 3600))
    finished = {}
    while sched.has_unfinished_requests():
        finished.update(step(sched))
    assert finished == {"running": ("length", None), "old": ("length", None)}
