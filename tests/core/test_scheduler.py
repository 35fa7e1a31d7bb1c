"""Scheduler driven by a fake model runner (no model, no torch).

The fake runner keeps per-request state only from the SchedulerOutput diffs, as a real runner
does, writes each computed token id into a fake paged KV cache at its slot, and checks that every
position a request attends to reads back the right token: a wrong block table, a bad prefix hit
or an evicted shared block fails the test. Its "model" is deterministic in the token history, so
the expected output of every request is known without running the scheduler.
"""

from __future__ import annotations

import itertools
import random
import zlib
from dataclasses import dataclass, field

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

# -- helpers -----------------------------------------------------------------------------------


def next_token(token_ids: list[int]) -> int:
    return (token_ids[-1] * 7 + len(token_ids)) % 1000


def expected_tokens(prompt: list[int], num: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 1024,
    chunked: bool = True,
    policy: str = "priority",
    caching: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, chunked, policy),
        CacheConfig(block_size, num_blocks, caching),
    )


_clock = itertools.count(1)


def prompt_of(length: int, seed: int | str = 0) -> list[int]:
    if isinstance(seed, str):
        seed = zlib.crc32(seed.encode()) % 1000  # stable across processes, unlike str hashing
    return [(seed * 131 + i * 17 + 3) % 1000 for i in range(length)]


def make_request(
    req_id: str,
    prompt: list[int] | int,
    max_tokens: int = 4,
    priority: int = 0,
    arrival_time: float | None = None,
    eos: int | None = None,
    **params,
) -> Request:
    if isinstance(prompt, int):
        prompt = prompt_of(prompt, seed=req_id)
    return Request(
        req_id, prompt, SamplingParams(max_tokens=max_tokens, **params), eos,
        arrival_time=float(next(_clock)) if arrival_time is None else arrival_time, priority=priority,
    )


@dataclass
class _RunnerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed: int
    params: SamplingParams
    num_prompt: int


class FakeRunner:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.block_size
        self.kv: list[int | None] = [None] * (scheduler.block_pool.num_blocks * self.block_size)
        self.state: dict[str, _RunnerState] = {}
        self.script: dict[str, list[list[int]]] = {}  # req_id -> sampled lists to return instead

    def _slot(self, st: _RunnerState, pos: int) -> int:
        return st.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _check_kv(self, st: _RunnerState, end: int) -> None:
        for pos in range(end):
            assert self.kv[self._slot(st, pos)] == st.token_ids[pos], f"bad KV at position {pos}"

    def _apply_diffs(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.state.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.state
            self.state[new.req_id] = _RunnerState(
                new.prompt_token_ids + new.output_token_ids, list(new.block_ids), new.num_computed_tokens,
                new.sampling_params, len(new.prompt_token_ids),
            )
        for cached in out.scheduled_cached_reqs:
            st = self.state[cached.req_id]
            assert st.num_computed == cached.num_computed_tokens
            st.block_ids.extend(cached.new_block_ids)
        scheduled = [n.req_id for n in out.scheduled_new_reqs] + [c.req_id for c in out.scheduled_cached_reqs]
        assert sorted(scheduled) == sorted(out.num_scheduled_tokens)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diffs(out)
        kv_manager = self.scheduler.kv_cache_manager
        for req_id, n in out.num_scheduled_tokens.items():
            st = self.state[req_id]
            assert st.block_ids == kv_manager.get_block_ids(req_id), "runner block table out of sync"
            assert len(st.block_ids) * self.block_size >= st.num_computed + n
            self._check_kv(st, st.num_computed)  # KV it reuses was written by an earlier step
        for req_id, n in out.num_scheduled_tokens.items():
            st = self.state[req_id]
            for pos in range(st.num_computed, st.num_computed + n):
                self.kv[self._slot(st, pos)] = st.token_ids[pos]
        result = ModelRunnerOutput([], [])
        for req_id, n in out.num_scheduled_tokens.items():
            st = self.state[req_id]
            start, st.num_computed = st.num_computed, st.num_computed + n
            self._check_kv(st, st.num_computed)
            sampled: list[int] = []
            if st.num_computed == len(st.token_ids):
                script = self.script.get(req_id)
                sampled = script.pop(0) if script else [next_token(st.token_ids)]
                st.token_ids.extend(sampled)
            result.req_ids.append(req_id)
            result.sampled_token_ids.append(sampled)
            if st.params.prompt_logprobs is not None:
                positions = range(start, min(st.num_computed, st.num_prompt))
                result.prompt_logprobs[req_id] = [TokenLogprobs([st.token_ids[p]], [-1.0], [1]) for p in positions]
        return result


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_outputs: int = 0


def step(
    scheduler: Scheduler, runner: FakeRunner, results: dict[str, Result] | None = None
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step, with the per-step checks every test relies on."""
    config = scheduler.scheduler_config
    out = scheduler.schedule()
    scheduler.check_integrity()
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= config.max_num_seqs
    assert all(n > 0 for n in out.num_scheduled_tokens.values())
    assert not out.preempted_req_ids & set(out.num_scheduled_tokens)
    if out.preempted_req_ids:
        assert not out.scheduled_new_reqs, "nobody is admitted in a step that preempted"
    outputs = scheduler.update_from_output(out, runner.execute(out))
    scheduler.check_integrity()
    assert len({o.req_id for o in outputs}) == len(outputs)
    if results is not None:
        for o in outputs:
            r = results.setdefault(o.req_id, Result())
            assert r.finish_reason is None, "output after finishing"
            r.tokens += o.new_token_ids
            r.finish_reason, r.stop_reason = o.finish_reason, o.stop_reason
            r.num_cached_tokens = o.num_cached_tokens
            r.num_outputs += 1
    return out, outputs


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> dict[str, Result]:
    results: dict[str, Result] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler, runner, results)
    assert not scheduler.has_unfinished_requests(), "did not finish"
    assert scheduler.block_pool.get_num_free_blocks() == scheduler.block_pool.num_blocks, "leaked blocks"
    return results


def setup(**kwargs) -> tuple[Scheduler, FakeRunner]:
    scheduler = make_scheduler(**kwargs)
    return scheduler, FakeRunner(scheduler)


# -- the token budget --------------------------------------------------------------------------


def test_budget_respected_and_outputs_correct_in_a_busy_workload():
    scheduler, runner = setup(num_blocks=200, max_num_seqs=5, max_num_batched_tokens=32)
    rng = random.Random(0)
    reqs = [make_request(f"r{i}", rng.randint(1, 70), max_tokens=rng.randint(1, 12)) for i in range(25)]
    for r in reqs:
        scheduler.add_request(r)
    results = run_to_completion(scheduler, runner)
    for r in reqs:
        assert results[r.request_id].tokens == expected_tokens(r.prompt_token_ids, r.max_tokens)
        assert results[r.request_id].finish_reason == "length"
    assert scheduler.stats().num_preemptions_total == 0


def test_long_prompt_is_chunked_over_several_steps():
    scheduler, runner = setup(max_num_batched_tokens=32)
    r = make_request("long", 100, max_tokens=3)
    scheduler.add_request(r)
    results: dict[str, Result] = {}
    chunks = []
    for _ in range(4):
        out, outputs = step(scheduler, runner, results)
        chunks.append(out.num_scheduled_tokens["long"])
        if len(chunks) < 4:
            assert outputs == []  # partial prefill: nothing sampled, nothing reported
    assert chunks == [32, 32, 32, 4]
    assert len(results["long"].tokens) == 1
    out, _ = step(scheduler, runner, results)
    assert out.num_scheduled_tokens == {"long": 1}


def test_mixed_prefill_and_decode_in_one_step():
    scheduler, runner = setup(max_num_batched_tokens=32)
    scheduler.add_request(make_request("a", 8, max_tokens=10))
    step(scheduler, runner)
    scheduler.add_request(make_request("b", 40, max_tokens=2))
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 31}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["b"]
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["a"]


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits_and_blocks_the_line():
    scheduler, runner = setup(max_num_batched_tokens=32, chunked=False)
    scheduler.add_request(make_request("a", 8, max_tokens=3))
    step(scheduler, runner)
    scheduler.add_request(make_request("b", 32, max_tokens=2))
    scheduler.add_request(make_request("c", 4, max_tokens=2))  # would fit, but must not skip b
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == {"a": 1}
    results = run_to_completion(scheduler, runner)
    assert set(results) == {"a", "b", "c"}
    assert all(r.finish_reason == "length" for r in results.values())


def test_without_chunked_prefill_prompts_are_never_split():
    scheduler, runner = setup(max_num_batched_tokens=40, chunked=False, max_num_seqs=4)
    for i in range(8):
        scheduler.add_request(make_request(f"r{i}", 15 + i, max_tokens=3))
    prompt_lens = {f"r{i}": 15 + i for i in range(8)}
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, runner)
        for new in out.scheduled_new_reqs:
            assert out.num_scheduled_tokens[new.req_id] == prompt_lens[new.req_id]


def test_max_num_seqs_limits_running_requests():
    scheduler, runner = setup(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", 5, max_tokens=3))
    out, _ = step(scheduler, runner)
    assert sorted(out.num_scheduled_tokens) == ["r0", "r1"]
    assert scheduler.stats().num_running == 2 and scheduler.stats().num_waiting == 3
    run_to_completion(scheduler, runner)


def test_empty_schedule():
    scheduler, runner = setup()
    out, outputs = step(scheduler, runner)
    assert out.is_empty and outputs == []


# -- priority and order ------------------------------------------------------------------------


def admission_order(scheduler: Scheduler, runner: FakeRunner) -> list[str]:
    order = []
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, runner)
        order += [n.req_id for n in out.scheduled_new_reqs]
    return order


def test_priority_larger_first_then_arrival_then_insertion():
    scheduler, runner = setup(max_num_seqs=1)
    scheduler.add_request(make_request("low", 4, priority=0, arrival_time=1.0))
    scheduler.add_request(make_request("high-late", 4, priority=5, arrival_time=3.0))
    scheduler.add_request(make_request("high-early", 4, priority=5, arrival_time=2.0))
    scheduler.add_request(make_request("mid", 4, priority=1, arrival_time=0.5))
    scheduler.add_request(make_request("tie-a", 4, priority=-1, arrival_time=7.0))
    scheduler.add_request(make_request("tie-b", 4, priority=-1, arrival_time=7.0))
    assert admission_order(scheduler, runner) == ["high-early", "high-late", "mid", "low", "tie-a", "tie-b"]


def test_fcfs_ignores_priority():
    scheduler, runner = setup(max_num_seqs=1, policy="fcfs")
    scheduler.add_request(make_request("a", 4, priority=0))
    scheduler.add_request(make_request("b", 4, priority=9))
    scheduler.add_request(make_request("c", 4, priority=5))
    assert admission_order(scheduler, runner) == ["a", "b", "c"]


def test_bad_policy_and_duplicate_id():
    with pytest.raises(ValueError):
        make_scheduler(policy="lifo")
    scheduler, _ = setup()
    scheduler.add_request(make_request("x", 4))
    with pytest.raises(ValueError, match="request_id"):
        scheduler.add_request(make_request("x", 4))


# -- preemption --------------------------------------------------------------------------------


def run_pair_until_preemption(policy: str) -> tuple[Scheduler, FakeRunner, dict[str, Result], SchedulerOutput]:
    # 10 blocks of 4 tokens; each request grows to 12 + 12 tokens (6 blocks): both cannot finish.
    scheduler, runner = setup(num_blocks=10, policy=policy)
    scheduler.add_request(make_request("first", 12, max_tokens=12, priority=0))
    scheduler.add_request(make_request("second", 12, max_tokens=12, priority=1))
    results: dict[str, Result] = {}
    for _ in range(100):
        out, _ = step(scheduler, runner, results)
        if out.preempted_req_ids:
            return scheduler, runner, results, out
    raise AssertionError("no preemption")


@pytest.mark.parametrize("policy, victim", [("priority", "first"), ("fcfs", "second")])
def test_preemption_victim_and_identical_output(policy, victim):
    scheduler, runner, results, out = run_pair_until_preemption(policy)
    survivor = ({"first", "second"} - {victim}).pop()
    assert out.preempted_req_ids == {victim}
    assert survivor in out.num_scheduled_tokens
    req = scheduler.get_request(victim)
    assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
    assert scheduler.stats().num_preemptions_total == 1
    assert scheduler.waiting.peek() is req
    num_out_before = req.num_output_tokens
    assert num_out_before > 0
    resumed = None
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, runner, results)
        for new in out.scheduled_new_reqs:
            if new.req_id == victim and resumed is None:
                resumed = new
    assert resumed is not None and len(resumed.output_token_ids) == num_out_before
    assert resumed.num_computed_tokens > 0  # its own blocks were still cached
    for name in ("first", "second"):
        r = results[name]
        prompt = prompt_of(12, seed=name)
        assert r.tokens == expected_tokens(prompt, 12) and r.finish_reason == "length"
    assert scheduler.stats().num_preemptions_total >= 1
    assert scheduler.block_pool.get_num_free_blocks() == 10


def test_request_preempts_itself_when_it_is_the_lowest():
    # 4 blocks of 4. 'high' (front of the running queue) holds 1 block then 2; 'low' (back) holds
    # 2 and needs a 3rd at position 8 while none is free: the lowest-ranked running request is
    # 'low' itself, so it is preempted and 'high' still runs in that step.
    scheduler, runner = setup(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("high", 4, max_tokens=5, priority=1))
    scheduler.add_request(make_request("low", 7, max_tokens=4, priority=0))
    results: dict[str, Result] = {}
    outs = [step(scheduler, runner, results)[0] for _ in range(3)]
    assert [o.preempted_req_ids for o in outs] == [set(), set(), {"low"}]
    assert outs[2].num_scheduled_tokens == {"high": 1}
    results_rest = run_to_completion(scheduler, runner)
    assert results_rest["low"].finish_reason == "length" and results_rest["high"].finish_reason == "length"
    low_tokens = results["low"].tokens + results_rest["low"].tokens
    assert low_tokens == expected_tokens(prompt_of(7, seed="low"), 4)


def test_preemption_under_pressure_gives_the_same_tokens_as_a_big_pool():
    def workload(num_blocks: int) -> tuple[dict[str, Result], int]:
        scheduler, runner = setup(num_blocks=num_blocks, max_num_seqs=6, max_num_batched_tokens=24)
        rng = random.Random(5)
        for i in range(14):
            prompt = prompt_of(rng.randint(3, 30), seed=rng.randint(0, 2))  # shared prefixes
            scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randint(5, 25),
                                               priority=rng.randint(0, 2)))
        return run_to_completion(scheduler, runner), scheduler.stats().num_preemptions_total

    small, num_preempted = workload(16)
    big, none_preempted = workload(500)
    assert num_preempted > 3 and none_preempted == 0
    assert {k: v.tokens for k, v in small.items()} == {k: v.tokens for k, v in big.items()}


# -- abort and finish_requests -----------------------------------------------------------------


def test_abort_waiting_running_preempted_unknown_and_twice():
    scheduler, runner, _, _ = run_pair_until_preemption("priority")
    preempted = scheduler.get_request("first")
    assert preempted.status == RequestStatus.PREEMPTED
    scheduler.add_request(make_request("waiting", 4))
    assert scheduler.finish_requests("nope", RequestStatus.FINISHED_ABORTED) == []
    done = scheduler.finish_requests(["first", "second", "waiting", "first"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["first", "second", "waiting"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED and r.get_finish_reason() == "abort" for r in done)
    assert scheduler.finish_requests("second", RequestStatus.FINISHED_ABORTED) == []
    scheduler.check_integrity()
    assert scheduler.block_pool.get_num_free_blocks() == 10 and scheduler.stats().kv_cache_usage == 0.0
    assert not scheduler.has_unfinished_requests() and scheduler.has_finished_requests()
    out, outputs = step(scheduler, runner)
    assert out.finished_req_ids == {"first", "second", "waiting"} and outputs == []
    assert not runner.state and not scheduler.has_finished_requests()
    out, _ = step(scheduler, runner)
    assert out.finished_req_ids == set()


def test_abort_between_schedule_and_update():
    scheduler, runner = setup()
    scheduler.add_request(make_request("a", 10, max_tokens=5))
    scheduler.add_request(make_request("b", 10, max_tokens=5))
    out = scheduler.schedule()
    scheduler.check_integrity()
    runner_output = runner.execute(out)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    outputs = scheduler.update_from_output(out, runner_output)
    scheduler.check_integrity()
    assert [o.req_id for o in outputs] == ["b"]
    out, _ = step(scheduler, runner)
    assert out.finished_req_ids == {"a"} and "a" not in runner.state


def test_finish_requests_for_a_stop_string():
    scheduler, runner = setup()
    scheduler.add_request(make_request("a", 10, max_tokens=50))
    step(scheduler, runner)
    (req,) = scheduler.finish_requests(("a",), RequestStatus.FINISHED_STOPPED)
    assert req.get_finish_reason() == "stop"
    assert scheduler.block_pool.get_num_free_blocks() == scheduler.block_pool.num_blocks
    with pytest.raises(ValueError):
        scheduler.finish_requests("a", RequestStatus.RUNNING)


def test_request_too_big_for_the_pool_is_aborted_not_deadlocked():
    scheduler, runner = setup(num_blocks=4, block_size=4)  # 16 token slots in all
    scheduler.add_request(make_request("huge", 20, max_tokens=2))
    scheduler.add_request(make_request("ok", 5, max_tokens=2))
    results = run_to_completion(scheduler, runner)
    assert results["huge"].finish_reason == "abort" and results["huge"].tokens == []
    assert results["ok"].finish_reason == "length"


def test_request_that_outgrows_the_pool_alone_is_aborted():
    scheduler, runner = setup(num_blocks=4, block_size=4)
    scheduler.add_request(make_request("grows", 14, max_tokens=10))
    results = run_to_completion(scheduler, runner)
    # Tokens at positions 14, 15, 16 were sampled; the KV of position 16 needs a 5th block.
    assert results["grows"].finish_reason == "abort"
    assert results["grows"].tokens == expected_tokens(prompt_of(14, seed="grows"), 3)


def test_prompt_longer_than_the_whole_budget_without_chunking_is_aborted():
    scheduler, runner = setup(max_num_batched_tokens=16, chunked=False)
    scheduler.add_request(make_request("long", 17))
    scheduler.add_request(make_request("short", 16))
    results = run_to_completion(scheduler, runner)
    assert results["long"].finish_reason == "abort" and results["short"].finish_reason == "length"


# -- prefix caching through the scheduler ------------------------------------------------------


def test_prefix_hits_are_counted_and_reported():
    scheduler, runner = setup(block_size=16, num_blocks=32, max_num_batched_tokens=256)
    prefix = prompt_of(48, seed=7)
    scheduler.add_request(make_request("a", prefix + [1, 2, 3], max_tokens=2))
    results = run_to_completion(scheduler, runner)
    assert results["a"].num_cached_tokens == 0
    scheduler.add_request(make_request("b", prefix + [4, 5], max_tokens=2))
    scheduler.add_request(make_request("same-48", list(prefix), max_tokens=2))
    results = run_to_completion(scheduler, runner)
    assert results["b"].num_cached_tokens == 48
    assert results["same-48"].num_cached_tokens == 32  # capped at num_tokens - 1, whole blocks
    stats = scheduler.stats()
    assert stats.prefix_cache_queries == 51 + 50 + 48
    assert stats.prefix_cache_hits == 48 + 32
    assert results["b"].tokens == expected_tokens(prefix + [4, 5], 2)


def test_no_prefix_hits_with_caching_disabled():
    scheduler, runner = setup(block_size=16, num_blocks=32, caching=False, max_num_batched_tokens=256)
    prefix = prompt_of(48, seed=7)
    scheduler.add_request(make_request("a", prefix + [1], max_tokens=2))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("b", prefix + [2], max_tokens=2))
    assert run_to_completion(scheduler, runner)["b"].num_cached_tokens == 0
    assert scheduler.stats().prefix_cache_hits == 0


def test_running_requests_share_blocks_and_shared_blocks_survive_pressure():
    # Two requests run on the same cached prefix while a third forces evictions: the runner's KV
    # check fails if a block still referenced by a request were handed out again.
    scheduler, runner = setup(num_blocks=14, block_size=4, max_num_batched_tokens=64)
    prefix = prompt_of(16, seed=3)
    scheduler.add_request(make_request("warm", prefix + [1], max_tokens=1))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("x", prefix + [2], max_tokens=8))
    scheduler.add_request(make_request("y", prefix + [3], max_tokens=8))
    scheduler.add_request(make_request("z", 20, max_tokens=8))
    step(scheduler, runner)
    shared = scheduler.kv_cache_manager.get_block_ids("x")[:4]
    assert scheduler.kv_cache_manager.get_block_ids("y")[:4] == shared
    assert all(scheduler.block_pool.blocks[b].ref_cnt == 2 for b in shared)
    results = run_to_completion(scheduler, runner)
    assert results["x"].num_cached_tokens == 16 and results["y"].num_cached_tokens == 16


def test_prompt_logprobs_skip_the_cache_and_flow_through_partial_prefills():
    scheduler, runner = setup(max_num_batched_tokens=8)
    prompt = prompt_of(20, seed=1)
    scheduler.add_request(make_request("warm", prompt, max_tokens=1))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("lp", prompt, max_tokens=2, prompt_logprobs=1))
    positions = []
    results: dict[str, Result] = {}
    while scheduler.has_unfinished_requests():
        _, outputs = step(scheduler, runner, results)
        for o in outputs:
            positions += [lp.token_ids[0] for lp in (o.new_prompt_logprobs or [])]
    assert positions == prompt
    assert results["lp"].num_cached_tokens == 0 and results["lp"].num_outputs == 4


# -- stop conditions ---------------------------------------------------------------------------


def run_scripted(req: Request, script: list[list[int]], **kwargs) -> Result:
    scheduler, runner = setup(**kwargs)
    scheduler.add_request(req)
    runner.script[req.request_id] = [list(s) for s in script]
    return run_to_completion(scheduler, runner)[req.request_id]


EOS = 999


def test_max_tokens_finishes_with_length():
    r = run_scripted(make_request("a", 5, max_tokens=3, eos=EOS), [])
    assert r.finish_reason == "length" and len(r.tokens) == 3 and r.stop_reason is None


def test_eos_stops_with_no_stop_reason():
    r = run_scripted(make_request("a", 5, max_tokens=10, eos=EOS), [[1], [2], [EOS], [3]])
    assert r.tokens == [1, 2, EOS] and r.finish_reason == "stop" and r.stop_reason is None


def test_stop_token_ids_stop_with_the_token_as_reason():
    req = make_request("a", 5, max_tokens=10, eos=EOS, stop_token_ids=[42, EOS])
    r = run_scripted(req, [[1], [42], [3]])
    assert r.tokens == [1, 42] and r.finish_reason == "stop" and r.stop_reason == 42
    r = run_scripted(make_request("b", 5, max_tokens=10, eos=EOS, stop_token_ids=[EOS]), [[EOS]])
    assert r.stop_reason == EOS  # stop_token_ids are checked before EOS


def test_min_tokens_suppresses_eos_and_stop_token_ids():
    req = make_request("a", 5, max_tokens=10, eos=EOS, min_tokens=3, stop_token_ids=[42])
    r = run_scripted(req, [[EOS], [42], [EOS], [4]])
    assert r.tokens == [EOS, 42, EOS] and r.finish_reason == "stop" and r.stop_reason is None


def test_ignore_eos():
    req = make_request("a", 5, max_tokens=4, eos=EOS, ignore_eos=True)
    r = run_scripted(req, [[EOS], [EOS], [EOS], [EOS]])
    assert r.tokens == [EOS] * 4 and r.finish_reason == "length"


def test_max_model_len_finishes_with_length():
    r = run_scripted(make_request("a", 10, max_tokens=100), [], max_model_len=14)
    assert len(r.tokens) == 4 and r.finish_reason == "length"


def test_tokens_after_a_stop_in_one_step_are_dropped():
    r = run_scripted(make_request("a", 5, max_tokens=10, eos=EOS), [[1, EOS, 7, 8]])
    assert r.tokens == [1, EOS] and r.finish_reason == "stop"


def test_logprobs_are_carried_and_trimmed():
    scheduler, runner = setup()
    scheduler.add_request(make_request("a", 4, max_tokens=5, eos=EOS))
    out = scheduler.schedule()
    scheduler.check_integrity()
    lps = [TokenLogprobs([t], [-0.5], [1]) for t in (3, EOS, 5)]
    outputs = scheduler.update_from_output(out, ModelRunnerOutput(["a"], [[3, EOS, 5]], logprobs=[lps]))
    (o,) = outputs
    assert o.new_token_ids == [3, EOS] and o.new_logprobs == lps[:2] and o.finished
    scheduler.check_integrity()


# -- property test: random add / abort / step --------------------------------------------------


class Workload:
    """Random operations on a small pool; tracks every request to prove nothing leaks or is lost."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        block_size = rng.choice([1, 2, 4, 8])
        chunked = rng.random() < 0.75
        self.scheduler = make_scheduler(
            num_blocks=rng.randint(-(-24 // block_size), 80 // block_size), block_size=block_size,
            max_num_seqs=rng.randint(1, 6),
            max_num_batched_tokens=rng.randint(8, 40) if chunked else rng.randint(28, 60),
            chunked=chunked, policy=rng.choice(["priority", "fcfs"]),
            caching=rng.random() < 0.8, max_model_len=rng.choice([40, 10_000]),
        )
        self.runner = FakeRunner(self.scheduler)
        self.results: dict[str, Result] = {}
        self.added: dict[str, Request] = {}
        self.aborted: set[str] = set()

    def add(self) -> None:
        rng = self.rng
        prompt = prompt_of(rng.randint(1, 30), seed=rng.randint(0, 3))  # a few shared prefixes
        req = make_request(f"q{len(self.added)}", prompt, max_tokens=rng.randint(1, 20),
                           priority=rng.randint(0, 3), eos=rng.choice([None, 500]))
        self.added[req.request_id] = req
        self.scheduler.add_request(req)

    def abort(self) -> None:
        ids = list(self.scheduler.requests) + ["ghost"]
        picked = self.rng.sample(ids, k=min(len(ids), self.rng.randint(1, 2)))
        for req in self.scheduler.finish_requests(picked, RequestStatus.FINISHED_ABORTED):
            self.aborted.add(req.request_id)

    def step(self) -> None:
        step(self.scheduler, self.runner, self.results)

    def random_op(self) -> None:
        op = self.rng.random()
        if op < 0.15:
            self.add()
        elif op < 0.2:
            self.abort()
        else:
            self.step()

    def finish(self) -> None:
        s = self.scheduler
        for req in s.finish_requests(list(s.requests), RequestStatus.FINISHED_ABORTED):
            self.aborted.add(req.request_id)
        self.step()  # delivers finished ids to the runner
        s.check_integrity()
        assert s.block_pool.get_num_free_blocks() == s.block_pool.num_blocks, "leaked blocks"
        assert not s.requests and not s.has_finished_requests() and not self.runner.state
        reported = {k for k, r in self.results.items() if r.finish_reason is not None}
        assert reported.isdisjoint(self.aborted), "finished twice"
        assert reported | self.aborted == set(self.added), "a request was lost"
        for req_id, req in self.added.items():
            tokens = self.results.get(req_id, Result()).tokens
            assert tokens == req.output_token_ids
            assert tokens == expected_tokens(req.prompt_token_ids, len(tokens))


@pytest.mark.parametrize("seed", range(8))
def test_random_operations_keep_integrity_and_lose_nothing(seed):
    workload = Workload(random.Random(seed))
    for _ in range(1500):
        workload.random_op()
    workload.finish()



# -- the decode fast path and async scheduling (one step in flight) ------------------------------


def test_decode_inside_the_last_block_allocates_nothing_and_accounts_tokens_exactly():
    scheduler, runner = setup(block_size=4, num_blocks=32)
    r = make_request("a", 6, max_tokens=20)
    scheduler.add_request(r)
    blocks = scheduler.kv_cache_manager.req_to_blocks
    while not r.is_finished():
        before = r.num_computed_tokens
        free_before = scheduler.block_pool.get_num_free_blocks()
        held_before = len(blocks.get("a", ()))
        out, _ = step(scheduler, runner)
        n = out.num_scheduled_tokens["a"]
        assert out.total_num_scheduled_tokens == n
        if out.scheduled_cached_reqs:
            (cached,) = out.scheduled_cached_reqs
            assert cached.num_computed_tokens == before  # the value before the step
            needed = -(-(before + n) // 4) - held_before
            assert len(cached.new_block_ids) == max(needed, 0)  # new blocks only past the last one
        if not r.is_finished():
            assert scheduler.block_pool.get_num_free_blocks() == free_before - (len(blocks["a"]) - held_before)
            assert r.num_computed_tokens == before + n
            assert len(blocks["a"]) == -(-r.num_computed_tokens // 4)
    assert r.output_token_ids == expected_tokens(r.prompt_token_ids, 20)
    assert scheduler.block_pool.get_num_free_blocks() == 32


def run_async(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> dict[str, Result]:
    """Drive the scheduler as EngineCore does with async scheduling: schedule and launch step N,
    then apply step N-1's results (their tokens were placeholders while step N was scheduled)."""
    results: dict[str, Result] = {}
    in_flight = None
    for _ in range(max_steps):
        if not (scheduler.has_unfinished_requests() or scheduler.has_finished_requests() or in_flight):
            break
        out = scheduler.schedule()
        scheduler.check_integrity()
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        launched = (out, runner.execute(out)) if not out.is_empty or out.finished_req_ids or out.preempted_req_ids else None
        if in_flight is not None:
            for o in scheduler.update_from_output(*in_flight):
                r = results.setdefault(o.req_id, Result())
                assert r.finish_reason is None, "output after finishing"
                r.tokens += o.new_token_ids
                r.finish_reason, r.stop_reason = o.finish_reason, o.stop_reason
            scheduler.check_integrity()
        in_flight = launched
    assert not scheduler.has_unfinished_requests(), "did not finish"
    assert scheduler.block_pool.get_num_free_blocks() == scheduler.block_pool.num_blocks, "leaked blocks"
    return results


@pytest.mark.parametrize("num_blocks", [400, 40])  # 40: preemption with tokens in flight
def test_async_scheduling_gives_the_same_tokens_and_stops(num_blocks):
    scheduler, runner = setup(num_blocks=num_blocks, block_size=4, max_num_seqs=6, max_num_batched_tokens=48)
    rng = random.Random(1)
    reqs = [make_request(f"r{i}", rng.randint(1, 30), max_tokens=rng.randint(1, 25)) for i in range(20)]
    # One request stops on EOS, one on a stop token after min_tokens: the token after it is in flight.
    eos_req = make_request("eos", [5, 6, 7], max_tokens=50, eos=expected_tokens([5, 6, 7], 4)[3])
    stop_tok = expected_tokens([9, 8], 6)
    stop_req = make_request("stop", [9, 8], max_tokens=50, stop_token_ids=[stop_tok[1], stop_tok[5]], min_tokens=3)
    for r in [*reqs, eos_req, stop_req]:
        scheduler.add_request(r)
    results = run_async(scheduler, runner)
    for r in reqs:
        assert results[r.request_id].tokens == expected_tokens(r.prompt_token_ids, r.max_tokens)
        assert results[r.request_id].finish_reason == "length"
        assert r.num_output_placeholders == 0 or r.is_finished()
    assert results["eos"].tokens == expected_tokens([5, 6, 7], 4) and results["eos"].finish_reason == "stop"
    assert results["stop"].tokens == stop_tok and results["stop"].stop_reason == stop_tok[5]
    if num_blocks == 40:
        assert scheduler.stats().num_preemptions_total > 0


def test_update_from_output_accepts_runner_rows_in_any_order():
    def run(reorder: bool) -> list[EngineCoreOutput]:
        scheduler, runner = setup()
        for i in range(4):
            scheduler.add_request(make_request(f"r{i}", 5 + i, max_tokens=3, arrival_time=float(i)))
        outputs = []
        while scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            result = runner.execute(out)
            if reorder:  # reversed rows, and a request that sampled nothing left out
                rows = [(r, t) for r, t in zip(result.req_ids, result.sampled_token_ids) if t or r != "r1"][::-1]
                result = ModelRunnerOutput([r for r, _ in rows], [t for _, t in rows])
            outputs += scheduler.update_from_output(out, result)
            scheduler.check_integrity()
        return outputs

    assert sorted(run(True), key=lambda o: o.req_id) == sorted(run(False), key=lambda o: o.req_id)

try:
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
except ImportError:  # pragma: no cover - hypothesis is optional
    RuleBasedStateMachine = None

if RuleBasedStateMachine is not None:

    class SchedulerMachine(RuleBasedStateMachine):
        @initialize(seed=st.integers(0, 2**32 - 1))
        def start(self, seed):
            self.workload = Workload(random.Random(seed))

        @rule()
        def add(self):
            self.workload.add()

        @rule()
        def abort(self):
            self.workload.abort()

        @rule(n=st.integers(1, 4))
        def steps(self, n):
            for _ in range(n):
                self.workload.step()

        @invariant()
        def intact(self):
            if hasattr(self, "workload"):
                self.workload.scheduler.check_integrity()

        def teardown(self):
            if hasattr(self, "workload"):
                self.workload.finish()

    SchedulerMachine.TestCase.settings = settings(
        max_examples=40, stateful_step_count=40, deadline=None, database=None,
        suppress_health_check=list(HealthCheck),
    )
    test_scheduler_state_machine = SchedulerMachine.TestCase


def test_core_never_imports_torch():
    import subprocess
    import sys

    code = (
        "import sys, pagedllm.core.scheduler, pagedllm.core.kv_cache_manager, pagedllm.core.block_pool\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'transformers')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
