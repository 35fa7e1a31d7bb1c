"""The scheduler's side of jump-forward, with a pure-Python grammar that forces tokens: jumped
tokens are appended in the update that samples before them, computed by the next step (the fake
runner checks every KV slot), limited by max_tokens, matched by stop strings, sent to the runner
once, and survive preemption."""

from __future__ import annotations

from pagedllm.core.sched_output import SchedulerOutput
from tests.core.test_scheduler import FakeRunner, make_request, make_scheduler, next_token, step

FORCED = [901, 902, 903]  # what the grammar forces after every sampled token


class ForcingGrammar:
    """Ready at once, never terminates; after each sampled token it forces ``FORCED``."""

    failed = False
    may_jump = True

    def __init__(self) -> None:
        self.accepted: list[int] = []
        self.jumps: list[list[int]] = []

    def is_ready(self) -> bool:
        return True

    def accept_tokens(self, token_ids: list[int]) -> bool:
        self.accepted += token_ids
        return True

    def is_terminated(self) -> bool:
        return False

    def jump_forward(self, max_tokens: int) -> list[int]:
        forced = FORCED[:max_tokens]
        self.accepted += forced
        self.jumps.append(forced)
        return forced


class JumpAwareRunner(FakeRunner):
    """The fake runner, plus what a real one does with ``jump_forward_tokens``: write them into the
    request's tokens at their position (the sync fake has no token in flight to drop)."""

    def __init__(self, scheduler) -> None:
        super().__init__(scheduler)
        self.received: list[tuple[str, int, list[int]]] = []

    def _apply_diffs(self, out: SchedulerOutput) -> None:
        super()._apply_diffs(out)
        for req_id, (start, token_ids) in out.jump_forward_tokens.items():
            st = self.state[req_id]
            assert start == len(st.token_ids), "jumped tokens follow the runner's last token"
            st.token_ids[start:] = token_ids
            self.received.append((req_id, start, list(token_ids)))


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    """Sample one token (the fake model), then the forced ones, until max_tokens."""
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_tokens:
        tokens.append(next_token(tokens))
        tokens += FORCED[: max_tokens - (len(tokens) - len(prompt))]
    return tokens[len(prompt):]


def run(scheduler, runner, results: dict | None = None) -> tuple[dict, list[SchedulerOutput]]:
    results, outs = {} if results is None else results, []
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, runner, results)
        outs.append(out)
    assert scheduler.block_pool.get_num_free_blocks() == scheduler.block_pool.num_blocks
    assert not scheduler._jump_forward_tokens and not scheduler._superseded_samples
    return results, outs


def constrained(req_id: str, prompt: int, max_tokens: int, **kwargs):
    request = make_request(req_id, prompt, max_tokens=max_tokens, **kwargs)
    request.structured_output_request = ForcingGrammar()
    return request


def test_jumped_tokens_are_computed_by_the_next_step_and_save_steps():
    scheduler = make_scheduler()
    runner = JumpAwareRunner(scheduler)
    request = constrained("j", 6, max_tokens=13)
    scheduler.add_request(request)
    results, outs = run(scheduler, runner)
    # 13 tokens = 4 sampled (each followed by 3 forced, the last jump cut to 0) in 4 steps, not 13.
    assert results["j"].tokens == expected_output(request.prompt_token_ids, 13)
    assert results["j"].finish_reason == "length"
    assert [o.num_scheduled_tokens["j"] for o in outs] == [6, 4, 4, 4]
    # Each update reports the sampled token with the jump that follows it (the detokenizer sees both).
    assert results["j"].num_outputs == 4
    # The runner got each jump once, with the step that computes it, at the right position.
    assert [(start, toks) for _, start, toks in runner.received] == [(7, FORCED), (11, FORCED), (15, FORCED)]


def test_max_tokens_truncates_a_jump_and_finishes_the_request():
    scheduler = make_scheduler()
    runner = JumpAwareRunner(scheduler)
    request = constrained("j", 5, max_tokens=3)  # 1 sampled + a jump cut from 3 tokens to 2
    scheduler.add_request(request)
    results, outs = run(scheduler, runner)
    assert results["j"].tokens == expected_output(request.prompt_token_ids, 3)
    assert results["j"].finish_reason == "length" and len(outs) == 1
    assert request.structured_output_request.jumps == [FORCED[:2]]
    assert not runner.received  # finished: nothing left to compute


def test_a_stop_string_inside_a_jump_cuts_it():
    def stop_checker(req_id, new_token_ids, stopped_on_token):
        if FORCED[1] in new_token_ids:  # the "text" of 902 completes a stop string
            return new_token_ids.index(FORCED[1]) + 1, "STOP"
        return None

    scheduler = make_scheduler()
    scheduler.stop_checker = stop_checker
    runner = JumpAwareRunner(scheduler)
    request = constrained("j", 5, max_tokens=50, stop=["STOP"])
    scheduler.add_request(request)
    results, _ = run(scheduler, runner)
    assert results["j"].tokens == expected_output(request.prompt_token_ids, 3)
    assert (results["j"].finish_reason, results["j"].stop_reason) == ("stop", "STOP")


def test_jumps_survive_preemption_and_mixed_batches():
    """A tight pool preempts requests with jumped tokens not yet computed; every request still
    gets the tokens it would get alone, and free requests are unaffected by their neighbours."""
    scheduler = make_scheduler(num_blocks=14, block_size=4, max_num_batched_tokens=24)
    runner = JumpAwareRunner(scheduler)
    requests = [constrained(f"j{i}", 5 + i, max_tokens=14) for i in range(3)]
    free = [make_request(f"f{i}", 7, max_tokens=10) for i in range(2)]
    for r in requests + free:
        scheduler.add_request(r)
    results, _ = run(scheduler, runner)
    assert scheduler.num_preemptions_total > 0
    for r in requests:
        assert results[r.request_id].tokens == expected_output(r.prompt_token_ids, 14)
    for r in free:
        tokens = list(r.prompt_token_ids)
        for _ in range(10):
            tokens.append(next_token(tokens))
        assert results[r.request_id].tokens == tokens[len(r.prompt_token_ids):]


def test_a_request_not_scheduled_keeps_its_jump_until_it_is():
    """The runner hears of jumped tokens with the step that schedules the request, however late:
    here a higher-priority prefill takes whole steps' budgets in between."""
    scheduler = make_scheduler(max_num_batched_tokens=8)
    runner = JumpAwareRunner(scheduler)
    request = constrained("j", 5, max_tokens=12)
    scheduler.add_request(request)
    results = {}
    step(scheduler, runner, results)  # j's prompt; it samples, then jumps
    scheduler.add_request(make_request("big", 30, max_tokens=1, priority=1))
    results, outs = run(scheduler, runner, results)
    sent = [(i, o.jump_forward_tokens["j"]) for i, o in enumerate(outs) if "j" in o.jump_forward_tokens]
    skipped = [i for i, o in enumerate(outs) if "j" not in o.num_scheduled_tokens]
    assert skipped, "the prefill was meant to crowd j out of some steps"
    assert all("j" in outs[i].num_scheduled_tokens for i, _ in sent)  # sent only when scheduled
    assert [start for _, (start, _) in sent] == [6, 10]  # each jump once, at its position
    assert results["j"].tokens == expected_output(request.prompt_token_ids, 12)
