"""Draft tokens through the scheduler, driven by a fake runner that verifies drafts (no model).

The runner's "model" is test_scheduler's deterministic ``next_token``; it accepts drafts while
they equal the model's greedy token and then samples one token at the first rejection (the
greedy verification rule of INTERFACES.md). Its KV is checked at every position it reuses, so a
rejected draft's KV counted as computed, or hashed into the prefix cache, fails the test. Every
step checks the scheduler's and the block pool's integrity (``step`` / ``run_async``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedllm.core.kv_cache_manager import hash_block_tokens
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import Request, RequestStatus
from tests.core.test_scheduler import (
    FakeRunner,
    Result,
    expected_tokens,
    make_request,
    make_scheduler,
    next_token,
    run_async,
    step,
)

Proposer = Callable[[str, list[int]], list[int]]


def perfect(k: int) -> Proposer:
    """Proposes the model's next k tokens: every draft is accepted."""

    def propose(req_id: str, token_ids: list[int]) -> list[int]:
        return expected_tokens(token_ids, k)

    return propose


def right_then_wrong(k: int, num_right: int) -> Proposer:
    """The first ``num_right`` drafts are the model's tokens, the rest are wrong."""

    def propose(req_id: str, token_ids: list[int]) -> list[int]:
        good = expected_tokens(token_ids, k)
        return good[:num_right] + [(t + 1) % 1000 for t in good[num_right:]]

    return propose


class DraftRunner(FakeRunner):
    """FakeRunner that computes scheduled drafts, verifies them greedily and proposes new ones."""

    def __init__(self, scheduler: Scheduler, proposer: Proposer | None) -> None:
        super().__init__(scheduler)
        self.proposer = proposer

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diffs(out)
        kv_manager = self.scheduler.kv_cache_manager
        result = ModelRunnerOutput([], [], draft_token_ids={} if self.proposer else None)
        for req_id, n in out.num_scheduled_tokens.items():
            st = self.state[req_id]
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            assert st.block_ids == kv_manager.get_block_ids(req_id), "runner block table out of sync"
            assert len(st.block_ids) * self.block_size >= st.num_computed + n, "no slot for a draft"
            self._check_kv(st, st.num_computed)
            if drafts:
                assert n == len(st.token_ids) - st.num_computed + len(drafts) == 1 + len(drafts)
            tokens = st.token_ids + drafts
            for pos in range(st.num_computed, st.num_computed + n):
                self.kv[self._slot(st, pos)] = tokens[pos]
            st.num_computed += n
            sampled: list[int] = []
            if st.num_computed == len(tokens):
                script = self.script.get(req_id)
                if script:
                    sampled = script.pop(0)
                else:
                    seq = list(st.token_ids)
                    for draft in drafts:
                        if draft != next_token(seq):
                            break
                        seq.append(draft)
                    sampled = seq[len(st.token_ids):] + [next_token(seq)]
                st.num_computed -= len(drafts) + 1 - len(sampled)  # rejected drafts are not computed
                st.token_ids.extend(sampled)
                self._check_kv(st, st.num_computed)
                if self.proposer is not None:
                    result.draft_token_ids[req_id] = self.proposer(req_id, st.token_ids)
            result.req_ids.append(req_id)
            result.sampled_token_ids.append(sampled)
        return result


def setup(proposer: Proposer | None, **kwargs) -> tuple[Scheduler, DraftRunner]:
    scheduler = make_scheduler(**kwargs)
    return scheduler, DraftRunner(scheduler, proposer)


def run(scheduler: Scheduler, runner: DraftRunner, max_steps: int = 1000) -> tuple[dict[str, Result], list[SchedulerOutput]]:
    results: dict[str, Result] = {}
    outs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        out, _ = step(scheduler, runner, results)
        for req_id, drafts in out.scheduled_spec_decode_tokens.items():
            assert out.num_scheduled_tokens[req_id] == 1 + len(drafts)
        outs.append(out)
    assert not scheduler.has_unfinished_requests(), "did not finish"
    assert scheduler.block_pool.get_num_free_blocks() == scheduler.block_pool.num_blocks, "leaked blocks"
    return results, outs


def num_drafts_scheduled(outs: list[SchedulerOutput], req_id: str) -> list[int]:
    return [len(o.scheduled_spec_decode_tokens[req_id]) for o in outs if req_id in o.scheduled_spec_decode_tokens]


# -- acceptance ----------------------------------------------------------------------------------


@pytest.mark.parametrize("proposer, tokens_per_draft_step", [
    (perfect(3), 4),  # full acceptance: 3 drafts + the token sampled after them
    (right_then_wrong(3, 1), 2),  # partial: one accepted, then the token sampled at the rejection
    (right_then_wrong(3, 0), 1),  # all rejected: only the token sampled at the first draft
])
def test_outputs_equal_plain_decoding_whatever_is_accepted(proposer, tokens_per_draft_step):
    scheduler, runner = setup(proposer, block_size=4)
    reqs = [make_request(f"r{i}", 5 + 3 * i, max_tokens=21) for i in range(3)]
    for r in reqs:
        scheduler.add_request(r)
    results, outs = run(scheduler, runner)
    for r in reqs:
        assert results[r.request_id].tokens == expected_tokens(r.prompt_token_ids, 21)
        assert results[r.request_id].finish_reason == "length"
        assert num_drafts_scheduled(outs, r.request_id), "drafts were never scheduled"
    steps_with_tokens = sum(1 for o in outs if "r0" in o.num_scheduled_tokens)
    # The prefill step samples 1 token; each draft step returns tokens_per_draft_step (the last
    # draft steps may have fewer drafts, or none, near max_tokens).
    assert steps_with_tokens <= 1 + -(-20 // tokens_per_draft_step) + 3


def test_rejected_drafts_roll_num_computed_tokens_back():
    scheduler, runner = setup(right_then_wrong(3, 1), block_size=4)
    req = make_request("a", 6, max_tokens=30)
    scheduler.add_request(req)
    step(scheduler, runner)  # prefill, proposes 3 drafts
    assert req.spec_token_ids == right_then_wrong(3, 1)("a", req.all_token_ids)
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": runner.proposer("a", req.all_token_ids)}
    # 7 known tokens (6 computed), then the last known token and 3 drafts.
    assert out.num_scheduled_tokens == {"a": 4} and req.num_computed_tokens == 7 + 3
    assert req.spec_token_ids == [] and req.num_output_placeholders == 4
    scheduler.update_from_output(out, runner.execute(out))
    scheduler.check_integrity()
    # 1 draft accepted + 1 sampled: 9 known tokens, 8 computed (the last one's KV comes next step).
    assert req.num_tokens == 9 and req.num_computed_tokens == 8 and req.num_output_placeholders == 0
    assert req.num_drafts_in_flight == 0


# -- stops inside an accepted run ------------------------------------------------------------------


def test_eos_inside_an_accepted_run_truncates_it():
    expected = expected_tokens([4, 5, 6], 12)
    scheduler, runner = setup(perfect(4), block_size=4)
    scheduler.add_request(make_request("a", [4, 5, 6], max_tokens=50, eos=expected[6]))
    results, outs = run(scheduler, runner)
    assert results["a"].tokens == expected[:7] and results["a"].finish_reason == "stop"
    assert results["a"].stop_reason is None
    assert num_drafts_scheduled(outs, "a") == [4, 4]  # EOS is the 2nd token of the 2nd draft run


def test_stop_token_inside_a_run_respects_min_tokens():
    expected = expected_tokens([7, 8], 12)
    scheduler, runner = setup(perfect(4), block_size=4)
    # expected[1] would stop, but min_tokens=3 suppresses it; expected[4] stops.
    scheduler.add_request(make_request("a", [7, 8], max_tokens=50, stop_token_ids=[expected[1], expected[4]],
                                       min_tokens=3))
    results, _ = run(scheduler, runner)
    assert results["a"].tokens == expected[:5] and results["a"].stop_reason == expected[4]


def test_max_tokens_ends_exactly_at_the_end_of_an_accepted_run():
    scheduler, runner = setup(perfect(3), block_size=4)
    req = make_request("a", 5, max_tokens=5)  # prefill samples 1, one run of 3 drafts + 1 brings 5
    scheduler.add_request(req)
    results, outs = run(scheduler, runner)
    assert results["a"].tokens == expected_tokens(req.prompt_token_ids, 5)
    assert results["a"].finish_reason == "length" and len(outs) == 2


def test_tokens_after_a_stop_in_a_runner_list_are_dropped():
    scheduler, runner = setup(lambda req_id, token_ids: [next_token(token_ids), 999, 5], block_size=4)
    req = make_request("a", 5, max_tokens=50, stop_token_ids=[999])
    scheduler.add_request(req)
    step(scheduler, runner)
    first = next_token(req.all_token_ids)
    runner.script["a"] = [[first, 999, 5, 6]]  # every draft accepted, then 6 sampled
    results: dict[str, Result] = {}
    step(scheduler, runner, results)
    assert results["a"].tokens == [first, 999] and results["a"].stop_reason == 999
    assert scheduler.block_pool.get_num_free_blocks() == scheduler.block_pool.num_blocks


# -- drafts that do not fit --------------------------------------------------------------------------


def test_drafts_that_would_pass_max_tokens_or_max_model_len_are_dropped_whole():
    scheduler, runner = setup(perfect(3), block_size=4, max_model_len=12)
    a = make_request("a", 5, max_tokens=3)  # after the prefill: 1 + 1 + 3 > 3
    b = make_request("b", 8, max_tokens=10)  # max_model_len 12: 9 + 1 + 3 > 12
    for r in (a, b):
        scheduler.add_request(r)
    results, outs = run(scheduler, runner)
    assert not num_drafts_scheduled(outs, "a") and not num_drafts_scheduled(outs, "b")
    assert results["a"].tokens == expected_tokens(a.prompt_token_ids, 3)
    assert results["b"].tokens == expected_tokens(b.prompt_token_ids, 4)


def test_drafts_that_do_not_fit_the_budget_are_dropped_whole():
    scheduler, runner = setup(perfect(3), block_size=4, max_num_batched_tokens=6)
    reqs = [make_request(f"r{i}", 2, max_tokens=12) for i in range(3)]
    for r in reqs:
        scheduler.add_request(r)
    results, outs = run(scheduler, runner)
    for o in outs:
        assert o.total_num_scheduled_tokens <= 6
        for drafts in o.scheduled_spec_decode_tokens.values():
            assert len(drafts) == 3  # whole, never a part
    assert any(o.scheduled_spec_decode_tokens for o in outs)
    # A step where the first request took 4 tokens leaves 2: the second one decodes without drafts.
    assert any(len(o.num_scheduled_tokens) > 1 and set(o.num_scheduled_tokens.values()) == {4, 1} for o in outs)
    for r in reqs:
        assert results[r.request_id].tokens == expected_tokens(r.prompt_token_ids, 12)


def test_drafts_without_room_in_the_pool_are_dropped_not_preempting():
    # 3 blocks of 4: the prompt (6) + sampled (1) fill 2 blocks; drafts would need a 3rd and 4th.
    scheduler, runner = setup(perfect(6), num_blocks=3, block_size=4)
    req = make_request("a", 6, max_tokens=6)
    scheduler.add_request(req)
    results, outs = run(scheduler, runner)
    assert results["a"].tokens == expected_tokens(req.prompt_token_ids, 6)
    assert not any(o.preempted_req_ids for o in outs)


# -- preemption and prefix caching -------------------------------------------------------------


def test_preempting_a_request_with_drafts_drops_them_and_loses_no_token():
    scheduler, runner = setup(right_then_wrong(3, 2), num_blocks=10, block_size=4, max_num_batched_tokens=64)
    reqs = [make_request(f"r{i}", 9, max_tokens=16) for i in range(3)]
    for r in reqs:
        scheduler.add_request(r)
    preempted_with_drafts = 0
    results: dict[str, Result] = {}
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        with_drafts = {r.request_id for r in scheduler.running if r.spec_token_ids}
        out, _ = step(scheduler, runner, results)
        for req_id in out.preempted_req_ids:
            req = scheduler.get_request(req_id)
            assert req.spec_token_ids == [] and req.num_drafts_in_flight == 0
            preempted_with_drafts += req_id in with_drafts
    assert preempted_with_drafts > 0
    for r in reqs:
        assert results[r.request_id].tokens == expected_tokens(r.prompt_token_ids, 16)


def test_prefix_cache_hashes_only_accepted_tokens():
    scheduler, runner = setup(right_then_wrong(3, 1), block_size=4)
    a = make_request("a", 6, max_tokens=20)
    scheduler.add_request(a)
    results: dict[str, Result] = {}
    while scheduler.has_unfinished_requests():
        step(scheduler, runner, results)
        if a.is_finished():
            break
        kv = scheduler.kv_cache_manager
        blocks = kv.req_to_blocks["a"]
        parent = None
        for i, block in enumerate(blocks[: kv.num_cached_blocks["a"]]):
            parent = hash_block_tokens(parent, a.all_token_ids[i * 4 : (i + 1) * 4])
            assert block.block_hash == parent, "a cached block's hash is not that of accepted tokens"
    # A second request with a's whole history as its prompt reuses a's blocks: the runner checks
    # every reused position's KV, so KV written by a rejected draft would fail here.
    b = make_request("b", a.prompt_token_ids + results["a"].tokens, max_tokens=3)
    scheduler.add_request(b)
    results_b, _ = run(scheduler, runner)
    assert results_b["b"].num_cached_tokens == 24
    assert results_b["b"].tokens == expected_tokens(b.prompt_token_ids, 3)


# -- async scheduling ----------------------------------------------------------------------------


def test_async_placeholders_count_every_draft_and_the_request_waits_for_them():
    scheduler, runner = setup(perfect(3), block_size=4)
    req = make_request("a", 5, max_tokens=13)
    scheduler.add_request(req)
    out0 = scheduler.schedule()  # prefill
    res0 = runner.execute(out0)
    out1 = scheduler.schedule()  # a plain decode of the token in flight (no drafts yet)
    assert out1.num_scheduled_tokens == {"a": 1} and req.num_output_placeholders == 2
    res1 = runner.execute(out1)
    scheduler.update_from_output(out0, res0)  # drafts for after token 1; token 2 is in flight
    assert req.spec_token_ids and req.num_output_placeholders == 1
    out2 = scheduler.schedule()
    assert out2.is_empty, "its drafts guess where the token in flight goes: it waits"
    res2 = runner.execute(out2)
    scheduler.update_from_output(out1, res1)  # fresh drafts, nothing in flight
    scheduler.update_from_output(out2, res2)
    out3 = scheduler.schedule()
    assert out3.num_scheduled_tokens == {"a": 4} and len(out3.scheduled_spec_decode_tokens["a"]) == 3
    assert req.num_output_placeholders == 4 and req.num_drafts_in_flight == 3
    res3 = runner.execute(out3)
    out4 = scheduler.schedule()
    assert out4.is_empty, "drafts in flight: how many come back is unknown"
    scheduler.update_from_output(out3, res3)
    scheduler.check_integrity()
    assert req.num_output_placeholders == 0 and req.num_output_tokens == 2 + 4


@pytest.mark.parametrize("proposer", [perfect(3), right_then_wrong(4, 2), right_then_wrong(2, 0)])
@pytest.mark.parametrize("num_blocks", [400, 30])  # 30: preemption with drafts in flight
def test_async_scheduling_with_drafts_gives_the_same_tokens(proposer, num_blocks):
    scheduler, runner = setup(proposer, num_blocks=num_blocks, block_size=4, max_num_seqs=6, max_num_batched_tokens=40)
    reqs = [make_request(f"r{i}", 3 + (7 * i) % 20, max_tokens=5 + (5 * i) % 17) for i in range(12)]
    eos_req = make_request("eos", [5, 6, 7], max_tokens=50, eos=expected_tokens([5, 6, 7], 9)[8])
    for r in [*reqs, eos_req]:
        scheduler.add_request(r)
    results = run_async(scheduler, runner)
    for r in reqs:
        assert results[r.request_id].tokens == expected_tokens(r.prompt_token_ids, r.max_tokens)
    assert results["eos"].tokens == expected_tokens([5, 6, 7], 9) and results["eos"].finish_reason == "stop"


# -- stop strings decided in the update ------------------------------------------------------------


class StopOn:
    """A stop checker that 'detokenizes' a token id as its decimal text and stops on a string."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.text: dict[str, str] = {}
        self.calls: list[tuple[str, list[int], bool]] = []

    def __call__(self, req_id: str, new_token_ids: list[int], stopped_on_token: bool):
        self.calls.append((req_id, list(new_token_ids), stopped_on_token))
        for i, token_id in enumerate(new_token_ids):
            self.text[req_id] = self.text.get(req_id, "") + f"{token_id} "
            if self.stop in self.text[req_id]:
                return i + 1, self.stop
        return None


def test_stop_string_inside_an_accepted_run_finishes_at_its_token():
    expected = expected_tokens([3, 4], 12)
    checker = StopOn(f" {expected[5]} ")
    scheduler = Scheduler(make_scheduler().scheduler_config, make_scheduler(block_size=4).cache_config, checker)
    runner = DraftRunner(scheduler, perfect(4))
    scheduler.add_request(make_request("a", [3, 4], max_tokens=50, stop=["x"]))  # stop strings: checked
    scheduler.add_request(make_request("b", [3, 4], max_tokens=3))  # none: never asked about
    results, _ = run(scheduler, runner)
    assert results["a"].tokens == expected[:6]
    assert results["a"].finish_reason == "stop" and results["a"].stop_reason == checker.stop
    assert {c[0] for c in checker.calls} == {"a"}


def test_async_a_request_stopped_by_a_stop_string_emits_nothing_more():
    expected = expected_tokens([3, 4], 12)
    checker = StopOn(f" {expected[3]} ")
    scheduler = Scheduler(make_scheduler().scheduler_config, make_scheduler().cache_config, checker)
    runner = DraftRunner(scheduler, None)
    scheduler.add_request(make_request("a", [3, 4], max_tokens=50, stop=["x"]))
    results = run_async(scheduler, runner)  # asserts no output after the finishing one
    assert results["a"].tokens == expected[:4] and results["a"].stop_reason == checker.stop
    # The step in flight when the stop string was found computed expected[4]: it was dropped.
    assert runner.state.get("a") is None


def test_stop_checker_is_told_when_the_last_token_stopped_the_request():
    expected = expected_tokens([3, 4], 5)
    checker = StopOn("never")
    scheduler = Scheduler(make_scheduler().scheduler_config, make_scheduler().cache_config, checker)
    scheduler.add_request(make_request("a", [3, 4], max_tokens=50, eos=expected[2], stop=["x"]))
    results, _ = run(scheduler, DraftRunner(scheduler, None))
    assert results["a"].tokens == expected[:3]
    assert [c[2] for c in checker.calls] == [False, False, True]


# -- n > 1 siblings ----------------------------------------------------------------------------------


def siblings_of(prompt: list[int], n: int, max_tokens: int = 4) -> list[Request]:
    return [make_request(f"{i}_x", list(prompt), max_tokens=max_tokens, arrival_time=1.0) for i in range(n)]


def test_siblings_wait_for_the_prompt_then_hit_its_prefix_cache():
    scheduler, runner = setup(None, block_size=4, max_num_batched_tokens=8)
    first, *siblings = siblings_of(list(range(1, 19)), 3)
    scheduler.add_request(first, siblings)
    assert scheduler.get_num_unfinished_requests() == 3 and scheduler.stats().num_waiting == 3
    results: dict[str, Result] = {}
    out, _ = step(scheduler, runner, results)
    assert list(out.num_scheduled_tokens) == ["0_x"]  # 8 of 18 prompt tokens: siblings held
    step(scheduler, runner, results)
    out, _ = step(scheduler, runner, results)  # the prompt's last 2 tokens: first token sampled
    assert list(out.num_scheduled_tokens) == ["0_x"]
    out, _ = step(scheduler, runner, results)  # now the siblings come, hitting 16 cached tokens
    assert {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs} == {"1_x": 16, "2_x": 16}
    while scheduler.has_unfinished_requests():
        step(scheduler, runner, results)
    for r in (first, *siblings):
        assert results[r.request_id].tokens == expected_tokens(first.prompt_token_ids, 4)


def test_siblings_are_not_held_without_a_full_block_to_share():
    scheduler, runner = setup(None, block_size=4)
    first, *siblings = siblings_of([1, 2, 3], 2)
    scheduler.add_request(first, siblings)
    out, _ = step(scheduler, runner)
    assert set(out.num_scheduled_tokens) == {"0_x", "1_x"}


def test_aborting_a_held_sibling_or_the_first_sequence():
    scheduler, runner = setup(None, block_size=4, max_num_batched_tokens=8)
    first, *siblings = siblings_of(list(range(1, 19)), 3)
    scheduler.add_request(first, siblings)
    step(scheduler, runner)
    (aborted,) = scheduler.finish_requests("1_x", RequestStatus.FINISHED_ABORTED)
    scheduler.check_integrity()
    assert aborted is siblings[0] and scheduler.get_num_unfinished_requests() == 2
    scheduler.finish_requests("0_x", RequestStatus.FINISHED_ABORTED)  # its sibling is queued now
    scheduler.check_integrity()
    assert [r.request_id for r in scheduler.waiting] == ["2_x"]
    results: dict[str, Result] = {}
    while scheduler.has_unfinished_requests() or scheduler.has_finished_requests():
        step(scheduler, runner, results)
    assert results["2_x"].tokens == expected_tokens(first.prompt_token_ids, 4)
    with pytest.raises(ValueError, match="request_id"):
        scheduler.add_request(make_request("y", 4), [make_request("y", 4)])
