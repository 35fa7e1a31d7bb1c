"""StructuredOutputManager and StructuredOutputRequest on the SmolLM2 tokenizer (no model): the
compile cache, validation by field, the bitmask rows (drafts walked and rolled back), release."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from pagedllm import SamplingParams, StructuredOutputsParams
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.structured_output import StructuredOutputManager
from tests.helpers import default_tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


@pytest.fixture
def manager(tokenizer):
    m = StructuredOutputManager(tokenizer, len(tokenizer))
    yield m
    m.shutdown()


def allowed(row: np.ndarray, tokenizer) -> set[str]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[: len(tokenizer)]
    return {tokenizer.decode([t]) for t in np.flatnonzero(bits)}


def running_request(manager, req_id: str, params: StructuredOutputsParams, eos: int = 2) -> Request:
    request = Request(req_id, [1, 2, 3], SamplingParams(structured_outputs=params), eos)
    manager.prepare(params)
    manager.attach(request)
    request.status, request.num_output_placeholders = RequestStatus.RUNNING, 1
    return request


def test_same_schema_compiles_once_and_counts_hits(manager):
    for schema in (SCHEMA, json.dumps(SCHEMA), SCHEMA):
        manager.prepare(StructuredOutputsParams(json=schema))
    manager.prepare(StructuredOutputsParams(regex="[0-9]+"))
    for future in manager._cache.values():
        future.result()
    assert manager.num_compiled == 2 and manager.num_cache_hits == 2
    assert len(manager.take_compile_times()) == 2 and manager.take_compile_times() == []
    assert manager.compile_time_s > 0


@pytest.mark.parametrize("params, field", [
    (StructuredOutputsParams(json={"type": 5}), "json"),
    (StructuredOutputsParams(json="{not json"), "json"),
    (StructuredOutputsParams(regex="a(b"), "regex"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "grammar"),
])
def test_invalid_constraints_raise_value_error_naming_the_field(manager, params, field):
    with pytest.raises(ValueError) as e:
        manager.prepare(params)
    assert str(e.value).startswith(field)
    assert manager._cache == {}  # nothing kept: the next request with it is validated again


def test_bitmask_rows_follow_the_grammar_and_drafts_are_rolled_back(manager, tokenizer):
    request = running_request(manager, "r", StructuredOutputsParams(choice=["yes", "no"]))
    request.structured_output_request.compiled.result()
    assert manager.has_requests_in(SchedulerOutput(num_scheduled_tokens={"r": 1}))
    out = manager.grammar_bitmask(SchedulerOutput(num_scheduled_tokens={"r": 1}), {"r": request})
    assert out.req_ids == ["r"] and out.bitmask.shape == (1, (len(tokenizer) + 31) // 32)
    first = allowed(out.bitmask[0], tokenizer)
    assert "yes" in first and "no" in first and " yes" not in first and "maybe" not in first
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert len(yes) == 1
    # One draft ("yes"): row 0 as before, row 1 after "yes" allows only EOS; then rolled back.
    so = SchedulerOutput(num_scheduled_tokens={"r": 2}, scheduled_spec_decode_tokens={"r": yes})
    out = manager.grammar_bitmask(so, {"r": request})
    assert allowed(out.bitmask[0], tokenizer) == first
    assert allowed(out.bitmask[1], tokenizer) == {tokenizer.decode([2])}
    state = request.structured_output_request
    assert state.accept_tokens(yes) and not state.is_terminated()  # the draft was rolled back
    assert state.accept_tokens([2]) and state.is_terminated()
    assert not state.accept_tokens([5])  # nothing after the end


def test_requests_that_do_not_sample_get_no_row_and_release_frees_them(manager):
    params = StructuredOutputsParams(regex="[0-9]+")
    a, b = running_request(manager, "a", params), running_request(manager, "b", params)
    b.num_output_placeholders = 0  # a partial prefill: no token this step
    so = SchedulerOutput(num_scheduled_tokens={"a": 1, "b": 7, "free": 1})
    out = manager.grammar_bitmask(so, {"a": a, "b": b})
    assert out.req_ids == ["a"] and manager.num_bitmask_steps == 1 and manager.bitmask_time_s > 0
    assert manager.num_requests == 2
    manager.release({"a", "b", "unknown"})
    assert manager.num_requests == 0 and not manager.has_requests_in(so)


def test_a_compile_that_fails_later_marks_the_request_failed(manager):
    gate = threading.Event()

    def broken(grammar):
        gate.wait()
        raise RuntimeError("out of memory")

    manager.backend.compile = broken
    request = running_request(manager, "r", StructuredOutputsParams(regex="x+"))
    state = request.structured_output_request
    assert not state.is_ready() and not state.failed
    gate.set()
    state.compiled.exception()
    assert state.is_ready() and state.failed


def test_start_bitmask_returns_while_the_fill_thread_fills(manager, tokenizer):
    params = StructuredOutputsParams(json=SCHEMA)
    requests = {r: running_request(manager, r, params) for r in ("a", "b", "c")}
    for request in requests.values():
        request.structured_output_request.compiled.result()
    so = SchedulerOutput(num_scheduled_tokens=dict.fromkeys(requests, 1))
    expected = manager.grammar_bitmask(so, requests).bitmask.copy()  # filled, then waited for
    release, fill, threads = threading.Event(), manager._fill_rows, []

    def gated(*args):
        seconds = fill(*args)
        threads.append(threading.current_thread().name)
        assert release.wait(30)
        return seconds

    manager._fill_rows = gated
    manager._bitmask[:] = 0
    job = manager.start_bitmask(so, requests)
    assert job.req_ids == ["a", "b", "c"] and not job.future.done()  # the caller goes on meanwhile
    release.set()
    out = manager.finish_bitmask(job)
    assert threads[0].startswith("pagedllm-bitmask") and threading.current_thread().name not in threads
    np.testing.assert_array_equal(out.bitmask, expected)
    assert manager.num_bitmask_steps == 2 and manager.bitmask_wait_s > 0


def test_is_terminated_follows_stop_tokens_and_rollback(manager, tokenizer):
    request = running_request(manager, "r", StructuredOutputsParams(regex="[0-9]+"), eos=2)
    state = request.structured_output_request
    [one] = tokenizer.encode("1", add_special_tokens=False)
    assert state.accept_tokens([one]) and not state.is_terminated()
    assert state.accept_tokens([2]) and state.is_terminated()
    state.rollback(1)  # the stop token was a rejected draft
    assert not state.is_terminated() and state.accept_tokens([one, 2]) and state.is_terminated()


def walk_tokens(row: np.ndarray, rng: np.random.Generator, eos: int) -> int:
    """A random token the row allows (not EOS, unless it is the only one): the junk a model with
    random weights samples inside the grammar."""
    ids = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
    ids = ids[ids != eos] if len(ids) > 1 else ids
    return int(rng.choice(ids))


@pytest.mark.parametrize("num_threads, on_fill_thread", [(0, False), (3, False), (0, True)])
def test_batched_accepts_give_the_serial_matcher_states(manager, tokenizer, num_threads, on_fill_thread,
                                                        monkeypatch):
    """Pending tokens accepted by the step's batched accept (on ``num_threads`` helper threads, in
    chunks, or on the fill thread) leave each matcher where one-by-one accepts leave a reference
    matcher: every step's bitmask rows are equal, and the tokens wait in ``_pending`` until the
    bitmask needs them."""
    import xgrammar as xgr

    from pagedllm.structured_output import backend as backend_module

    monkeypatch.setattr(backend_module, "MIN_ACCEPT_CHUNK", 2)
    params = StructuredOutputsParams(json={"type": "object", "properties": {
        "name": {"type": "string"}, "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}}}, "required": ["name", "n", "tags"]})
    requests = {f"r{i}": running_request(manager, f"r{i}", params) for i in range(9)}
    manager.backend.accept_threads = num_threads
    manager.accepts_on_fill_thread = on_fill_thread
    compiled = requests["r0"].structured_output_request.compiled.result()
    reference = {r: xgr.GrammarMatcher(compiled, override_stop_tokens=[2]) for r in requests}
    expected = np.zeros((len(requests), (len(tokenizer) + 31) // 32), np.int32)
    so = SchedulerOutput(num_scheduled_tokens=dict.fromkeys(requests, 1))
    rng = np.random.default_rng(0)
    for _ in range(12):
        out = manager.grammar_bitmask(so, requests)
        assert out.req_ids == list(requests)
        for row, (req_id, matcher) in enumerate(reference.items()):
            matcher.fill_next_token_bitmask(expected, row)
            token = walk_tokens(expected[row], rng, eos=2)
            assert matcher.accept_token(token)
            state = requests[req_id].structured_output_request
            assert state.accept_tokens([token]) and state._pending == [token]  # not given to xgrammar yet
        np.testing.assert_array_equal(out.bitmask, expected)
    assert manager.accept_time_s > 0 and manager._fill_accepts is None


def test_a_refused_pending_token_allows_all_and_aborts_at_the_next_accept(manager, tokenizer):
    """A token the grammar refuses (the bitmask was not applied) is found by the batched accept:
    its row allows everything, the matcher stays before it, and the next accept answers False."""
    requests = {r: running_request(manager, r, StructuredOutputsParams(regex="[0-9]+")) for r in "ab"}
    [one] = tokenizer.encode("1", add_special_tokens=False)
    [letter] = tokenizer.encode("x", add_special_tokens=False)
    so = SchedulerOutput(num_scheduled_tokens=dict.fromkeys(requests, 1))
    manager.grammar_bitmask(so, requests)
    a, b = (requests[r].structured_output_request for r in "ab")
    assert a.accept_tokens([letter]) and b.accept_tokens([one])  # queued: not tried yet
    out = manager.grammar_bitmask(so, requests)
    assert (out.bitmask[0] == -1).all() and a.refused and not b.refused
    assert allowed(out.bitmask[1], tokenizer) >= {"1", tokenizer.decode([2])}
    assert not a.accept_tokens([one]) and b.accept_tokens([2]) and b.is_terminated()
    assert a.matcher.accept_token(one)  # still at the start: "x" was never accepted


@pytest.mark.parametrize("private_binding", [True, False])
def test_batch_accept_names_the_refusing_matchers(manager, tokenizer, monkeypatch, private_binding):
    """``batch_accept`` through xgrammar's private binding, and through the public wrapper that
    replaces it where a release moved it: the same matchers advance, the refusing ones are named."""
    from pagedllm.structured_output import backend

    if not private_binding:
        monkeypatch.setattr(backend, "_core_batch_accept", None)
    elif backend._core_batch_accept is None:
        pytest.skip("this xgrammar has no private batch-accept binding")
    compiled = manager.backend.compile(manager.backend.parse(StructuredOutputsParams(json=SCHEMA)))
    matchers = [manager.backend.new_matcher(compiled, [2]) for _ in range(3)]
    brace, close = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("{", "}"))
    assert manager.backend.batch_accept(matchers, [brace, close, brace]) == [1]
    # 1 stayed at the start (it takes "{" now); 0 and 2 are inside the object ("}" before "a")
    assert manager.backend.batch_accept(matchers, [close, brace, close]) == [0, 2]
