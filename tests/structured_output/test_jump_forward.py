"""Jump-forward decoding end to end: the jump string's tokens (tokenizer, fallback, refusals), and
a tiny random Llama with the SmolLM2 tokenizer under a schema with long fixed keys: jumped tokens
are exactly what the grammar forces, every sampled token is the greedy choice of transformers on
the whole text (so the KV of jumped tokens is right), fewer steps, max_tokens, stop strings,
logprobs, streaming, mixed batches, sync and async scheduling, nothing leaked."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import xgrammar as xgr

from pagedllm import LLM, EngineArgs, SamplingParams, StructuredOutputsParams
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.structured_output.jump_forward import JumpForward
from tests.helpers import default_tokenizer, make_tiny_model

SCHEMA = {  # long keys fixed by the schema: compact JSON leaves little for the model to choose
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 6},
        "shipping_city": {"enum": ["Rome", "Oslo", "Lima"]},
        "is_priority_customer": {"type": "boolean"},
    },
    "required": ["customer_full_name", "shipping_city", "is_priority_customer"],
    "additionalProperties": False,
}
CONSTRAINT = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
PROMPT = "A customer record:"


# -- tokenizing a jump string ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


@pytest.fixture(scope="module")
def info(tokenizer):
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))


def test_the_tokenizers_tokens_when_they_spell_the_string(tokenizer, info):
    jump = JumpForward.from_tokenizer(tokenizer, info)
    text = '{"customer_full_name": "'
    assert jump.tokenize(text) == tokenizer.encode(text, add_special_tokens=False)
    assert jump.tokenize(text) is jump.tokenize(text)  # cached


def test_a_tokenizer_that_prepends_a_space_falls_back_to_longest_match(tokenizer, info):
    """SentencePiece-style encoders add a space the grammar never asked for: the tokens must spell
    the jump string's bytes exactly, so the longest match over the vocabulary is used instead."""
    jump = JumpForward(lambda text: tokenizer.encode(" " + text, add_special_tokens=False),
                       info.decoded_vocab, [0, 1, 2])
    text = '": "customer_full_name'
    token_ids = jump.tokenize(text)
    assert tokenizer.decode(token_ids) == text
    assert len(token_ids) <= len(tokenizer.encode(text, add_special_tokens=False)) + 2


def test_a_special_token_in_the_jump_string_stops_the_jump(tokenizer):
    """A key holding a special token's text: the tokenizer maps it to the special id, the grammar
    refuses that id, so the jump stops before it and the model spells the rest token by token."""
    from pagedllm.structured_output import StructuredOutputManager

    manager = StructuredOutputManager(tokenizer, len(tokenizer), jump_forward=True)
    try:
        params = StructuredOutputsParams(json={"type": "object", "properties": {"a<|im_end|>b": {"type": "integer"}},
                                               "required": ["a<|im_end|>b"]}, disable_any_whitespace=True)
        from pagedllm.request import Request

        request = Request("r", [1, 2], SamplingParams(structured_outputs=params), eos_token_id=2)
        manager.prepare(params)
        manager.attach(request)
        state = request.structured_output_request
        assert state.jump_forward(100) == tokenizer.encode('{"a', add_special_tokens=False)
        assert state.matcher.find_jump_forward_string().startswith("<|im_end|>b")
        assert state.jump_forward(1) == []  # still forced, but its first token is refused
    finally:
        manager.shutdown()


def test_the_engine_arg_and_its_flag():
    assert EngineArgs().structured_outputs_jump_forward is False
    with pytest.raises(ValueError, match="^structured_outputs_jump_forward"):
        EngineArgs(structured_outputs_jump_forward="yes")
    import argparse

    from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--structured-outputs-jump-forward"]))
    assert args.structured_outputs_jump_forward is True


# -- through the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("jump_llama"))


@pytest.fixture(scope="module")
def engines(folder):
    """Engines by (async_scheduling, jump_forward), built on first use."""
    built: dict[tuple[bool, bool], LLM] = {}

    def get(async_scheduling: bool, jump_forward: bool) -> LLM:
        key = (async_scheduling, jump_forward)
        if key not in built:
            built[key] = LLM(folder, dtype="float32", max_model_len=512, max_num_seqs=8, block_size=4,
                             async_scheduling=async_scheduling, structured_outputs_jump_forward=jump_forward)
        return built[key]

    yield get
    for llm in built.values():
        llm.llm_engine.shutdown()


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def jumping(engines, request):
    """A jump-forward engine in each scheduling mode (async supersedes the sample in flight)."""
    llm = engines(request.param, True)
    yield llm
    check_nothing_leaked(llm)


@pytest.fixture(scope="module")
def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def check_nothing_leaked(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    pool = core.scheduler.block_pool
    core.scheduler.check_integrity()
    assert not llm.llm_engine.has_unfinished_requests()
    assert pool.get_num_free_blocks() == pool.num_blocks and core.structured_output.num_requests == 0
    assert not core.scheduler._jump_forward_tokens and not core.scheduler._superseded_samples


def greedy(max_tokens: int = 80, temperature: float = 0.0, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, structured_outputs=CONSTRAINT, **kwargs)


def jumped_tokens(llm: LLM) -> int:
    return llm.llm_engine.engine_core.structured_output.num_jumped_tokens


def count_steps(llm: LLM, monkeypatch) -> list[int]:
    """Counts the engine's non-empty steps (one entry per step, in a list the test reads)."""
    scheduler = llm.llm_engine.engine_core.scheduler
    steps, schedule = [], scheduler.schedule

    def counting():
        out = schedule()
        if not out.is_empty:
            steps.append(out.total_num_scheduled_tokens)
        return out

    monkeypatch.setattr(scheduler, "schedule", counting)
    return steps


def replay(llm: LLM, hf_model, prompt_ids: list[int], output_ids: list[int]) -> int:
    """Walk a fresh matcher over the output: after each sampled token, the grammar's forced string
    must follow as exactly its jump tokens; every other token must be transformers' greedy choice
    under the grammar's mask given everything before it. Returns the number of jumped tokens."""
    manager = llm.llm_engine.engine_core.structured_output
    compiled = manager.backend.compile(manager.backend.parse(CONSTRAINT))
    matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[2])
    tokenizer = llm.get_tokenizer()
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0, len(prompt_ids) - 1:].float()
    bitmask = xgr.allocate_token_bitmask(1, logits.shape[-1])
    i = num_jumped = 0
    while i < len(output_ids):
        matcher.fill_next_token_bitmask(bitmask)
        row = logits[i: i + 1].clone()
        xgr.apply_token_bitmask_inplace(row, bitmask)
        assert int(row.argmax()) == output_ids[i], f"sampled token {i} is not the greedy choice"
        assert matcher.accept_token(output_ids[i])
        i += 1
        forced = "" if matcher.is_terminated() else matcher.find_jump_forward_string()
        if forced and i < len(output_ids):
            expected = tokenizer.encode(forced, add_special_tokens=False)[: len(output_ids) - i]
            assert output_ids[i: i + len(expected)] == expected, f"tokens {i}.. are not the forced {forced!r}"
            if len(expected) == len(tokenizer.encode(forced, add_special_tokens=False)):
                assert tokenizer.decode(expected) == forced
            for token_id in expected:
                assert matcher.accept_token(token_id)
            i += len(expected)
            num_jumped += len(expected)
    return num_jumped


def test_jumped_tokens_are_forced_and_sampled_ones_are_greedy_on_the_right_kv(jumping, hf_model):
    before = jumped_tokens(jumping)
    out = jumping.generate(PROMPT, greedy(), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"
    jsonschema.validate(json.loads(completion.text), SCHEMA)
    num_jumped = replay(jumping, hf_model, out.prompt_token_ids, list(completion.token_ids))
    assert num_jumped >= 15 and jumped_tokens(jumping) - before == num_jumped
    assert completion.text == jumping.get_tokenizer().decode(completion.token_ids, skip_special_tokens=True)


def test_jump_forward_cuts_the_steps_of_a_schema_with_long_keys(engines, monkeypatch):
    results = {}
    for jump in (False, True):
        llm = engines(False, jump)
        llm.generate(PROMPT, greedy(max_tokens=1), use_tqdm=False)  # the grammar is compiled and cached
        steps = count_steps(llm, monkeypatch)
        before = jumped_tokens(llm)
        completion = llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0]
        jsonschema.validate(json.loads(completion.text), SCHEMA)
        results[jump] = (len(steps), len(completion.token_ids), jumped_tokens(llm) - before)
        check_nothing_leaked(llm)
    (steps_off, tokens_off, _), (steps_on, tokens_on, jumped) = results[False], results[True]
    assert steps_off == tokens_off  # one step per token
    assert steps_on == tokens_on - jumped and jumped >= 15  # one step per sampled token
    assert steps_on * 2 < steps_off


def test_max_tokens_cuts_a_jump(jumping):
    for max_tokens in (1, 2, 3, 5):
        completion = jumping.generate(PROMPT, greedy(max_tokens=max_tokens), use_tqdm=False)[0].outputs[0]
        assert len(completion.token_ids) == max_tokens and completion.finish_reason == "length"
        assert '{"customer_full_name":"'.startswith(completion.text)


def test_a_stop_string_inside_a_jump(jumping):
    completion = jumping.generate(PROMPT, greedy(stop=["full"]), use_tqdm=False)[0].outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == ('{"customer_', "stop", "full")


def test_requests_with_logprobs_sample_every_token(engines):
    """A jumped token has no logprobs, so a request asking for them is never jumped: its tokens
    and logprobs are those of the engine without jump-forward."""
    llm = engines(False, True)
    before = jumped_tokens(llm)
    with_logprobs = llm.generate(PROMPT, greedy(logprobs=1), use_tqdm=False)[0].outputs[0]
    assert jumped_tokens(llm) == before
    assert len(with_logprobs.logprobs) == len(with_logprobs.token_ids)
    plain = engines(False, False).generate(PROMPT, greedy(logprobs=1), use_tqdm=False)[0].outputs[0]
    assert with_logprobs.token_ids == plain.token_ids
    for mine, theirs in zip(with_logprobs.logprobs, plain.logprobs):
        assert mine.keys() == theirs.keys()
    check_nothing_leaked(llm)


def test_streaming_deltas_carry_the_jumped_tokens(jumping):
    engine = jumping.llm_engine
    engine.add_request("s", PROMPT, greedy(output_kind=RequestOutputKind.DELTA))
    text, token_ids, deltas = "", [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text
            token_ids += out.outputs[0].token_ids
            deltas.append(len(out.outputs[0].token_ids))
    assert max(deltas) > 1  # a sampled token and its jump arrive together
    assert text == jumping.get_tokenizer().decode(token_ids, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_mixed_batch_free_requests_unchanged(jumping):
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = jumping.generate(PROMPT, free, use_tqdm=False)[0].outputs[0].token_ids
    params = [greedy(), free, greedy(temperature=1.0, seed=5), greedy(max_tokens=4), free]
    outs = jumping.generate([PROMPT, PROMPT, "Another customer:", PROMPT, "Free text"], params, use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    for i in (0, 2):
        jsonschema.validate(json.loads(outs[i].outputs[0].text), SCHEMA)
    assert len(outs[3].outputs[0].token_ids) == 4


def test_an_idle_async_engine_waits_for_a_compile_instead_of_spinning(engines, monkeypatch):
    """With async scheduling an empty step leaves an empty step "in flight": the loop must still
    sleep on the compile (a spinning loop takes the CPU and the GIL from the compile threads)."""
    import threading

    llm = engines(True, True)
    llm.generate(PROMPT, greedy(max_tokens=1), use_tqdm=False)  # the tokenizer tables are built
    engine, manager = llm.llm_engine, llm.llm_engine.engine_core.structured_output
    gate, compile_ = threading.Event(), manager.backend.compile
    monkeypatch.setattr(manager.backend, "compile", lambda grammar: (gate.wait(30), compile_(grammar))[1])
    engine.add_request("slow", PROMPT, SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(
        regex="slow[0-9]+")))
    threading.Timer(0.3, gate.set).start()
    num_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    assert num_steps < 100  # about one 10 ms wait per step while compiling, not thousands of spins
    check_nothing_leaked(llm)


@pytest.mark.gpu
def test_jump_forward_on_cuda_with_async_steps_and_graphs(folder, hf_model):
    """The GPU runner path: async scheduling (the sample in flight is superseded, the device-side
    token forwarding must not feed it back), CUDA graphs for the pure-decode steps between jumps."""
    llm = LLM(folder, dtype="float32", max_model_len=512, max_num_seqs=8, device="cuda",
              structured_outputs_jump_forward=True)
    try:
        assert llm.llm_engine.config.async_scheduling
        prompts = [PROMPT, "Another customer:", "A third one:"]
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
        for out in outs:
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
            assert replay(llm, hf_model, out.prompt_token_ids, list(out.outputs[0].token_ids)) >= 15
        check_nothing_leaked(llm)
    finally:
        llm.llm_engine.shutdown()
