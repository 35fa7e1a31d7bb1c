"""Structured output through the offline API on the embedded SmolLM2 (real tokenizer, real text):
every constraint kind validated, greedy and sampled, sync and async scheduling, mixed batches,
a slow compile that stalls nobody, bad constraints refused with nothing leaked, abort, n > 1."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from tests.helpers import has_default_model

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not has_default_model(), reason="embedded SmolLM2 not installed")]

PROMPT = "Here is a person described in JSON:"
SCHEMA = {  # nested objects, an array, an enum; short strings keep the test fast
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                 "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "pets", "home"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["Paris", "London", 'say "hi"']
GRAMMAR = 'root ::= "yes" | "no" | ("maybe " [0-9])'
GRAMMAR_RE = r"yes|no|maybe [0-9]"


@pytest.fixture(scope="module")
def engines():
    """One engine per scheduling mode, built on first use."""
    built: dict[bool, LLM] = {}

    def get(async_scheduling: bool) -> LLM:
        if async_scheduling not in built:
            built[async_scheduling] = LLM(dtype="float32", max_model_len=256, max_num_seqs=8,
                                          async_scheduling=async_scheduling)
        return built[async_scheduling]

    yield get
    for engine in built.values():
        engine.llm_engine.shutdown()


@pytest.fixture
def llm(engines):
    """The synchronous engine (tests whose subject does not depend on the step order)."""
    return engines(False)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def any_llm(engines, request):
    """Both engines: the bitmask is filled at a different point of the step in each."""
    return engines(request.param)


def grammars(llm):
    return llm.llm_engine.engine_core.structured_output


def constrained(temperature: float = 0.0, max_tokens: int = 60, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=3, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**kwargs))


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(GRAMMAR_RE, text), text


# (kind, constraint, temperature): greedy and sampled, in one batch.
SPECS = [("json", {"json": SCHEMA, "disable_any_whitespace": True}, 0.0), ("json", {"json": SCHEMA}, 0.9),
         ("json_object", {"json_object": True, "disable_any_whitespace": True}, 0.0),
         ("regex", {"regex": REGEX}, 0.9), ("choice", {"choice": CHOICES}, 0.0), ("grammar", {"grammar": GRAMMAR}, 0.9)]


def test_every_kind_gives_valid_text_in_one_mixed_batch(any_llm):
    llm = any_llm
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(PROMPT, free, use_tqdm=False)[0].outputs[0].token_ids
    kinds = [kind for kind, _, _ in SPECS]
    params = [constrained(temperature, **spec) for _, spec, temperature in SPECS] + [free]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for kind, out in zip(kinds, outs):
        assert out.outputs[0].finish_reason == "stop", (kind, out.outputs[0].text)
        check(kind, out.outputs[0].text)
    assert outs[-1].outputs[0].token_ids == alone  # the free request is unchanged by its neighbours
    m = grammars(llm)
    assert m.num_requests == 0 and m.num_bitmask_steps > 0 and m.bitmask_time_s > 0
    llm.llm_engine.engine_core.scheduler.check_integrity()


def test_the_same_schema_compiles_once(llm):
    m = grammars(llm)
    before = m.num_compiled
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
              "additionalProperties": False}
    outs = llm.generate([PROMPT] * 3, [constrained(json=schema), constrained(json=json.dumps(schema)),
                                       constrained(json=schema, temperature=1.0)], use_tqdm=False)
    assert m.num_compiled == before + 1
    for out in outs:
        assert json.loads(out.outputs[0].text)["n"] in (1, 2, 3)


def test_n_sequences_and_seeds(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    first = llm.generate(PROMPT, params, use_tqdm=False)[0]
    again = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert len(first.outputs) == 3 and all(o.text in CHOICES for o in first.outputs)
    assert [o.text for o in first.outputs] == [o.text for o in again.outputs]


BAD = [({"json": {"type": 5}}, "json"), ({"json": "{oops"}, "json"), ({"regex": "[a-"}, "regex"),
       ({"grammar": "root ::= nothing"}, "grammar")]


def test_bad_constraints_are_refused_with_nothing_leaked(llm):
    engine = llm.llm_engine
    pool = engine.engine_core.scheduler.block_pool
    free_before = pool.get_num_free_blocks()
    for spec, field in BAD:
        with pytest.raises(ValueError) as e:
            engine.add_request("bad", PROMPT, constrained(**spec))
        assert str(e.value).startswith(field)
        assert not engine.has_unfinished_requests() and not engine.output_processor.has_request("bad")
        assert pool.get_num_free_blocks() == free_before
        engine.engine_core.scheduler.check_integrity()
    out = llm.generate(PROMPT, constrained(choice=CHOICES), use_tqdm=False)[0]  # the engine is unharmed
    assert out.outputs[0].text in CHOICES


def test_abort_of_a_constrained_request_frees_its_matcher_and_blocks(any_llm):
    llm = any_llm
    engine = llm.llm_engine
    pool = engine.engine_core.scheduler.block_pool
    engine.add_request("a", PROMPT, constrained(regex="[a-z ]+", max_tokens=200))
    for _ in range(4):
        engine.step()
    state = engine.engine_core.scheduler.get_request("a").structured_output_request
    assert grammars(llm).num_requests == 1 and state.matcher is not None
    engine.abort_request("a")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.outputs[0].finish_reason for o in outputs if o.finished] == ["abort"]
    assert grammars(llm).num_requests == 0
    assert pool.get_num_free_blocks() == pool.num_blocks
    engine.engine_core.scheduler.check_integrity()


def test_a_slow_compile_does_not_stall_other_requests(llm, monkeypatch):
    engine, m = llm.llm_engine, grammars(llm)
    gate, compile_ = threading.Event(), m.backend.compile
    monkeypatch.setattr(m.backend, "compile", lambda grammar: (gate.wait(30), compile_(grammar))[1])
    engine.add_request("slow", PROMPT, constrained(regex="slow[0-9]"))
    engine.add_request("free", PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    finished = {}
    while "free" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    slow = engine.engine_core.scheduler.get_request("slow")
    assert slow.first_scheduled_time is None and slow.num_computed_tokens == 0  # waits for its grammar
    gate.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert re.fullmatch("slow[0-9]", finished["slow"].outputs[0].text)


def test_steps_without_constrained_requests_keep_the_plain_path(llm, monkeypatch):
    m = grammars(llm)

    def refuse(*args):
        raise AssertionError("the grammar path ran for a step without constrained requests")

    monkeypatch.setattr(m, "has_requests_in", refuse)
    monkeypatch.setattr(m, "grammar_bitmask", refuse)
    steps = m.num_bitmask_steps
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and m.num_bitmask_steps == steps and m.num_requests == 0


def test_async_steps_fill_the_bitmask_beside_the_next_schedule(engines, monkeypatch):
    """Async: a constrained step returns with its bitmask still filling (it is sampled by the next
    step, after that step has scheduled), and the text still follows the grammar."""
    llm = engines(True)
    engine, m = llm.llm_engine, grammars(llm)
    core = engine.engine_core
    events: list[str] = []
    release, fill, schedule = threading.Event(), m._fill_rows, core.scheduler.schedule

    def gated_fill(*args):
        seconds = fill(*args)
        assert release.wait(30)
        return seconds

    def recorded(name, fn):
        def call(*args):
            result = fn(*args)
            if result is not None:  # None: no constrained request samples in the step
                events.append(name)
            return result
        return call

    for name in ("start_bitmask", "finish_bitmask"):
        monkeypatch.setattr(m, name, recorded(name, getattr(m, name)))
    monkeypatch.setattr(core.scheduler, "schedule", lambda: (events.append("schedule"), schedule())[1])
    monkeypatch.setattr(m, "_fill_rows", gated_fill)
    engine.add_request("r", PROMPT, constrained(json=SCHEMA, max_tokens=80))
    state = core.scheduler.get_request("r").structured_output_request
    state.compiled.result(timeout=60)
    for _ in range(20):
        engine.step()
        if core._unsampled is not None:
            break
    assert core._unsampled is not None and not core._unsampled[1].future.done()  # step() returned first
    release.set()
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    check("json", finished[0].outputs[0].text)
    starts = [i for i, event in enumerate(events) if event == "start_bitmask"]
    assert len(starts) > 3 and all(events[i + 1:i + 3] == ["schedule", "finish_bitmask"] for i in starts)
    assert core._unsampled is None and m.num_requests == 0
