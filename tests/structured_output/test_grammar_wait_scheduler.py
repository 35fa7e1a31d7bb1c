"""The scheduler's side of structured output, with a pure-Python stand-in for the grammar state:
a request waits (others pass it) until its grammar is ready, a failed grammar aborts it, the
grammar advances by accepted tokens and finishes the request when it terminates or refuses."""

from __future__ import annotations

from pagedllm.request import RequestStatus
from tests.core.test_scheduler import make_request, run_to_completion, setup, step


def run(scheduler, runner, results: dict) -> dict:
    """Step to the end, adding every output to ``results``."""
    while scheduler.has_unfinished_requests():
        step(scheduler, runner, results)
    assert scheduler.block_pool.get_num_free_blocks() == scheduler.block_pool.num_blocks
    return results


class FakeGrammar:
    """Ready when told; terminates after ``length`` tokens; refuses every token if ``refuse``."""

    may_jump = False

    def __init__(self, length: int = 1000, refuse: bool = False) -> None:
        self.ready = False
        self.failed = False
        self.length, self.refuse = length, refuse
        self.accepted: list[int] = []

    def is_ready(self) -> bool:
        return self.ready

    def accept_tokens(self, token_ids: list[int]) -> bool:
        if self.refuse:
            return False
        self.accepted += token_ids
        return True

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length

    def jump_forward(self, max_tokens: int) -> list[int]:
        return []  # jump-forward: test_jump_forward_scheduler.py


def constrained(req_id: str, grammar: FakeGrammar, **kwargs):
    request = make_request(req_id, 6, **kwargs)
    request.structured_output_request = grammar
    return request


def test_a_request_waits_for_its_grammar_while_others_pass_it_and_run():
    scheduler, runner = setup()
    grammar = FakeGrammar()
    scheduler.add_request(constrained("g", grammar, max_tokens=3))
    scheduler.add_request(make_request("free", 6, max_tokens=3))
    results = {}
    for _ in range(5):
        out, _ = step(scheduler, runner, results)
        assert "g" not in out.num_scheduled_tokens
    assert results["free"].finish_reason == "length"
    assert scheduler.requests["g"].status == RequestStatus.WAITING and scheduler.requests["g"].num_computed_tokens == 0
    grammar.ready = True
    run(scheduler, runner, results)
    assert results["g"].finish_reason == "length" and len(results["g"].tokens) == 3
    assert grammar.accepted == results["g"].tokens[:2]  # the last token finished it: not walked


def test_grammar_termination_stops_the_request_and_a_refusal_aborts_it():
    scheduler, runner = setup()
    done, refusing = FakeGrammar(length=2), FakeGrammar(refuse=True)
    done.ready = refusing.ready = True
    scheduler.add_request(constrained("done", done, max_tokens=10, ignore_eos=True))
    scheduler.add_request(constrained("refused", refusing, max_tokens=10))
    results = run(scheduler, runner, {})
    assert results["done"].finish_reason == "stop" and results["done"].stop_reason is None
    assert len(results["done"].tokens) == 2 == len(done.accepted)
    assert results["refused"].finish_reason == "abort" and len(results["refused"].tokens) == 1


def test_a_failed_grammar_aborts_the_request_with_nothing_held():
    scheduler, runner = setup()
    grammar = FakeGrammar()
    grammar.ready = grammar.failed = True
    scheduler.add_request(constrained("bad", grammar))
    scheduler.add_request(make_request("free", 6, max_tokens=2))
    results = run_to_completion(scheduler, runner)
    assert results["bad"].finish_reason == "abort" and results["bad"].tokens == []
    assert results["free"].finish_reason == "length"
