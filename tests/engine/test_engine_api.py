"""The seed spec's examples 1-4 against the embedded SmolLM2, and the engine API's contract for
bad input and aborts: clear errors naming the field, nothing leaked, the engine keeps serving."""

from __future__ import annotations

import pytest

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_engine_args(EngineArgs(max_num_seqs=8, max_model_len=256))


def drain(engine, limit: int = 5000) -> dict[str, object]:
    finished = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.engine_core.scheduler.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.engine_core.scheduler.block_pool.get_usage() == 0.0
    return finished


@pytest.mark.slow
def test_example_1_offline_generate():
    llm = LLM(max_model_len=512)
    prompts = ["Hello, my name is", "The capital of France is"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, seed=1), use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    for o in outputs:
        assert o.finished and len(o.outputs[0].token_ids) <= 12 and o.outputs[0].text
    greedy = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert greedy[0].outputs[0].text.startswith(" Paris")
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert "Paris" in chat[0].outputs[0].text


def test_example_2_streaming_step_loop(engine):
    engine.add_request("request-1", "Write a short story about AI:", SamplingParams(temperature=0.0, max_tokens=20))
    texts = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append(out.outputs[0].text)
            if out.finished:
                final = out
    assert final is not None and final.outputs[0].finish_reason in ("length", "stop")
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1)), "cumulative text grows"
    assert texts[-1] == final.outputs[0].text


def test_example_3_abort(engine):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for i in range(10):
        engine.add_request(f"request-{i}", f"Write a long article about topic {i}:", params)
    for _ in range(5):
        engine.step()
    engine.abort_request(["request-3", "request-4", "request-5"])
    engine.abort_request(["request-3", "no-such-request"])  # idempotent, unknown ids ignored
    assert engine.engine_core.scheduler.get_request("request-3") is None, "aborted requests free at once"
    finished = drain(engine)
    for i in range(10):
        reason = finished[f"request-{i}"].outputs[0].finish_reason
        assert reason == ("abort" if i in (3, 4, 5) else "length")


def test_example_4_priority():
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    low = LLMEngine.from_engine_args(EngineArgs(max_num_seqs=1, max_model_len=256))
    for i in range(3):
        low.add_request(f"low-priority-{i}", f"Low priority task {i}", params, priority=0)
    low.add_request("high-priority-urgent", "URGENT: High priority task", params, priority=10)
    order = [rid for rid, _ in sorted(drain_order(low), key=lambda x: x[1])]
    # One slot: all four wait, the larger priority is served first, then arrival order.
    assert order == ["high-priority-urgent", "low-priority-0", "low-priority-1", "low-priority-2"], order


def drain_order(engine):
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if out.finished:
                yield out.request_id, step


@pytest.mark.parametrize(
    "call, exc, field",
    [
        (lambda e: e.add_request(7, "x", SamplingParams()), TypeError, "request_id"),
        (lambda e: e.add_request("e1", "", SamplingParams()), ValueError, "prompt"),
        (lambda e: e.add_request("e2", {"prompt_token_ids": []}, SamplingParams()), ValueError, "prompt"),
        (lambda e: e.add_request("e3", {"prompt_token_ids": [1] * 300}, SamplingParams()), ValueError, "prompt"),
        (lambda e: e.add_request("e4", {"prompt_token_ids": [10**9]}, SamplingParams()), ValueError, "prompt_token_ids"),
        (lambda e: e.add_request("e5", "x", "not params"), TypeError, "params"),
        (lambda e: e.add_request("e6", 3.5, SamplingParams()), TypeError, "prompt"),
        (lambda e: e.add_request("e7", {"prompt": "x", "multi_modal_data": {"image": b""}}, SamplingParams()),
         ValueError, "multi_modal_data"),
        (lambda e: e.add_request("e8", {"prompt": "x", "cache_salt": "s"}, SamplingParams()), ValueError, "cache_salt"),
    ],
)
def test_bad_input_names_the_field_and_the_engine_keeps_serving(engine, call, exc, field):
    with pytest.raises(exc, match=field):
        call(engine)
    engine.add_request("after-error", "Still serving?", SamplingParams(max_tokens=3, ignore_eos=True))
    finished = drain(engine)
    assert len(finished["after-error"].outputs[0].token_ids) == 3


def test_duplicate_live_request_id_is_rejected(engine):
    engine.add_request("dup", "hello", SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", "hello again", SamplingParams())
    drain(engine)
    engine.add_request("dup", "reuse after it finished", SamplingParams(max_tokens=2))  # fine once finished
    drain(engine)


def test_reaching_max_model_len_finishes_with_length(engine):
    prompt = {"prompt_token_ids": list(range(100, 350))}  # 250 of max_model_len 256
    engine.add_request("long", prompt, SamplingParams(max_tokens=100, ignore_eos=True))
    out = drain(engine)["long"].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6


def test_cli_generate(capsys):
    from pagedllm.entrypoints.cli import main

    assert main(["generate", "The capital of France is", "--max-tokens", "4", "--max-model-len", "128"]) == 0
    assert "The capital of France is" in capsys.readouterr().out
