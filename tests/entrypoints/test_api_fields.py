"""The server says what it does: every request field of the status table behaves as documented,
prompt_logprobs come back, beam search serves completions, and OpenAI's validation holds.

In process (no subprocess, no port): ``build_app`` around an AsyncLLMEngine on the embedded
SmolLM2, driven by starlette's TestClient.
"""

from __future__ import annotations

import json
import logging

import pytest
from starlette.testclient import TestClient

from pagedllm.beam_search import BeamSearchParams
from pagedllm.config import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm import LLM
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.field_status import (
    CHAT,
    COMPLETIONS,
    FIELDS,
    Status,
    check_extra_fields,
    fields_of,
)
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.timeout(300)

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 8
ENGINE = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, kv_cache_memory=64 * 2**20)
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
BASE = {COMPLETIONS: ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}),
        CHAT: ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "temperature": 0})}
# Fields whose example needs a companion field to be meaningful (OpenAI's / vLLM's rules).
COMPANIONS = {"stream_options": {"stream": True}, "top_logprobs": {"logprobs": True},
              "tool_choice": {"tools": [{"type": "function", "function": {"name": "f"}}]},
              "length_penalty": {"use_beam_search": True}, "early_stopping": {"use_beam_search": True},
              "best_of": {"n": 1}, "continue_final_message": {"add_generation_prompt": False}}


@pytest.fixture(scope="module")
def client():
    engine = AsyncLLMEngine(LLMEngine.from_engine_args(EngineArgs(**ENGINE)), log_stats=False)
    app = build_app(engine, max_waiting_requests=None)
    with TestClient(app) as test_client:
        yield test_client


def _post(client, endpoint: str, **fields):
    path, base = BASE[endpoint]
    return client.post(path, json={**base, **fields})


def _error(resp) -> dict:
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


def _rows():
    return [pytest.param(endpoint, row, id=f"{endpoint}-{row.name}")
            for row in FIELDS for endpoint in row.endpoints]


# -- the table ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint,row", _rows())
def test_every_field_of_the_table_does_what_the_table_says(client, endpoint, row):
    fields = {**COMPANIONS.get(row.name, {}), row.name: row.example} if row.status is Status.WORKS \
        else {row.name: row.example}
    resp = _post(client, endpoint, **fields)
    if row.status is Status.REFUSED:
        err = _error(resp)
        assert err["param"] == row.name and row.name in err["message"], err
        return
    assert resp.status_code == 200, resp.text
    ignored = resp.headers.get("x-ignored-fields", "").split(",")
    assert (row.name in ignored) == (row.status is Status.IGNORED)


@pytest.mark.parametrize("endpoint,model", [(COMPLETIONS, CompletionRequest), (CHAT, ChatCompletionRequest)])
def test_the_table_and_the_request_models_agree(endpoint, model):
    """A field works only if the model declares it (so flipping a row to works without wiring the
    field fails here), an ignored one must not be declared (it would not be reported), and every
    declared field has a row."""
    rows = fields_of(endpoint)
    declared = set(model.model_fields)
    assert {n for n, r in rows.items() if r.status is Status.WORKS} <= declared
    assert not {n for n, r in rows.items() if r.status is Status.IGNORED} & declared
    assert declared <= set(rows)


def test_refused_fields_pass_with_their_inert_values(client):
    inert = {"function_call": "none", "guided_whitespace_pattern": None, "include_reasoning": True}
    resp = _post(client, CHAT, **inert)
    assert resp.status_code == 200, resp.text
    assert "x-ignored-fields" not in resp.headers


def test_tools_without_tool_choice_reach_the_template_not_dropped(client):
    """tool_choice defaults to auto with tools (OpenAI's rule): the tools are in the prompt."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    plain = _post(client, CHAT).json()["usage"]["prompt_tokens"]
    with_tools = _post(client, CHAT, tools=tools)
    assert with_tools.status_code == 200 and with_tools.json()["usage"]["prompt_tokens"] > plain


def test_unknown_fields_are_logged_once_and_echoed_in_the_header_json_and_sse(client, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedllm.server"):
        for _ in range(2):
            resp = _post(client, COMPLETIONS, no_such_field_xyz=1, user="u")
            assert resp.status_code == 200 and resp.headers["x-ignored-fields"] == "no_such_field_xyz,user"
    assert sum("no_such_field_xyz" in r.getMessage() for r in caplog.records) == 1
    with client.stream("POST", "/v1/chat/completions",
                       json={**BASE[CHAT][1], "stream": True, "metadata": {"a": "b"}}) as resp:
        assert resp.status_code == 200 and resp.headers["x-ignored-fields"] == "metadata"
        assert resp.read().decode().rstrip().endswith("data: [DONE]")


def test_odd_field_names_cannot_break_the_header(client):
    odd = {"naïve ✓": 1, "a,b": 2, "x\r\nSet-Cookie: y": 3}
    resp = _post(client, COMPLETIONS, **odd)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-ignored-fields"] == "na\\u00efve \\u2713,a\\u002cb,x\\r\\nSet-Cookie: y"
    assert "set-cookie" not in resp.headers
    many = _post(client, COMPLETIONS, **{f"f{i}": i for i in range(40)}).headers["x-ignored-fields"].split(",")
    assert len(many) == 33 and many[-1] == "..."


def test_table_check_refuses_by_name():
    with pytest.raises(ValueError, match="^guided_whitespace_pattern: xgrammar"):
        check_extra_fields(COMPLETIONS, {"guided_whitespace_pattern": " "})
    assert check_extra_fields(COMPLETIONS, {"guided_whitespace_pattern": None}) == []


# -- response_format on completions ------------------------------------------------------------------
def test_completions_honour_response_format(client):
    text = _post(client, COMPLETIONS, max_tokens=8, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": ["yes", "no"]}}}).json()["choices"][0]["text"]
    assert json.loads(text) in ("yes", "no")
    assert _error(_post(client, COMPLETIONS, response_format={"type": "xml"}))["param"] == "response_format"
    assert _post(client, COMPLETIONS, response_format={"type": "text"}).status_code == 200


# -- prompt_logprobs ---------------------------------------------------------------------------------
def _check_prompt_logprobs(prompt_logprobs, prompt_ids: list[int], k: int) -> None:
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for token_id, position in zip(prompt_ids[1:], prompt_logprobs[1:]):
        assert str(token_id) in position and k <= len(position) <= k + 1
        ranks = sorted(p["rank"] for p in position.values())
        assert ranks[:k] == list(range(1, k + 1))
        for entry in position.values():
            assert entry["logprob"] <= 0 and isinstance(entry["decoded_token"], str)


def test_prompt_logprobs_on_completions_per_choice(client):
    prompt_ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    body = _post(client, COMPLETIONS, prompt_logprobs=2, n=2).json()
    assert len(body["choices"]) == 2
    for choice in body["choices"]:
        _check_prompt_logprobs(choice["prompt_logprobs"], prompt_ids, 2)
    assert _post(client, COMPLETIONS).json()["choices"][0]["prompt_logprobs"] is None


def test_prompt_logprobs_on_chat_at_the_top(client):
    prompt_ids = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    body = _post(client, CHAT, prompt_logprobs=1).json()
    _check_prompt_logprobs(body["prompt_logprobs"], prompt_ids, 1)
    assert "prompt_logprobs" not in body["choices"][0]


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_prompt_logprobs_refused_with_stream_as_vllm(client, endpoint):
    assert _error(_post(client, endpoint, prompt_logprobs=1, stream=True))["param"] == "prompt_logprobs"


# -- beam search -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def offline():
    return LLM(**ENGINE)


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
def test_beam_search_choices_equal_llm_beam_search_best_first(client, offline, early_stopping):
    width, max_tokens = 3, 6
    resp = _post(client, COMPLETIONS, use_beam_search=True, n=width, max_tokens=max_tokens, length_penalty=0.5,
                 early_stopping=early_stopping)
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    expected = offline.beam_search(PROMPT, BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                            length_penalty=0.5, early_stopping=early_stopping))
    [result] = expected
    prompt_len = len(offline.get_tokenizer().encode(PROMPT))
    texts = [offline.get_tokenizer().decode(b.tokens[prompt_len:], skip_special_tokens=True)
             for b in result.sequences]
    assert [c["index"] for c in choices] == list(range(width))
    assert [c["text"] for c in choices] == texts
    assert [c["finish_reason"] for c in choices] == [b.finish_reason for b in result.sequences]


def test_chat_beam_search_equals_llm_beam_search_on_the_rendered_prompt(client, offline):
    prompt_ids = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    body = _post(client, CHAT, use_beam_search=True, n=2, max_tokens=5).json()
    [result] = offline.beam_search({"prompt_token_ids": prompt_ids}, BeamSearchParams(beam_width=2, max_tokens=5,
                                                                                      early_stopping=False))
    texts = [offline.get_tokenizer().decode(b.tokens[len(prompt_ids):], skip_special_tokens=True)
             for b in result.sequences]
    assert [c["message"]["content"] for c in body["choices"]] == texts


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_beam_search_streams_each_beam_whole_then_done(client, endpoint):
    def text_of(choice: dict) -> str:
        return choice["text"] if endpoint == COMPLETIONS else choice.get("delta", choice.get("message", {}))["content"]

    full = _post(client, endpoint, use_beam_search=True, n=2, max_tokens=4).json()["choices"]
    path, base = BASE[endpoint]
    with client.stream("POST", path, json={**base, "use_beam_search": True, "n": 2, "max_tokens": 4,
                                           "stream": True}) as resp:
        text = resp.read().decode()
    assert text.rstrip().endswith("data: [DONE]")
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    streamed: dict[int, str] = {}
    for chunk in chunks:
        choice = chunk["choices"][0]
        streamed[choice["index"]] = streamed.get(choice["index"], "") + (text_of(choice) or "")
    assert streamed == {c["index"]: text_of(c) for c in full}


def test_beam_search_refuses_what_it_cannot_honour(client):
    for field, value in (("top_p", 0.5), ("logprobs", 1), ("stop", ["x"]), ("n", MAX_NUM_SEQS + 1)):
        assert _error(_post(client, COMPLETIONS, use_beam_search=True, **{field: value}))["param"] == field
    assert _error(_post(client, COMPLETIONS, length_penalty=0.5))["param"] == "length_penalty"
    assert _error(_post(client, COMPLETIONS, use_beam_search=True, early_stopping="soon"))["param"] == \
        "early_stopping"


# -- validation as OpenAI ----------------------------------------------------------------------------
def test_multimodal_parts_are_refused_naming_the_part(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    err = _error(_post(client, CHAT, messages=messages))
    assert err["param"] == "messages" and "'image_url' part" in err["message"]
    assert "template" not in err["message"]


@pytest.mark.parametrize("endpoint,fields,param", [
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, "messages"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages"),
    (COMPLETIONS, {"max_tokens": True}, "max_tokens"),
    (COMPLETIONS, {"n": "2"}, "n"),
    (CHAT, {"n": True}, "n"),
    (COMPLETIONS, {"temperature": "0.5"}, "temperature"),
    (COMPLETIONS, {"stream": "true"}, "stream"),
    (COMPLETIONS, {"n": MAX_NUM_SEQS + 1}, "n"),
    (CHAT, {"n": 1000}, "n"),
    (COMPLETIONS, {"best_of": 3}, "best_of"),
    (COMPLETIONS, {"logprobs": 10**6}, "logprobs"),
    (COMPLETIONS, {"prompt_logprobs": 10**6}, "prompt_logprobs"),
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_validation_is_400_naming_the_field(client, endpoint, fields, param):
    err = _error(_post(client, endpoint, **fields))
    assert err["param"] == param, err


@pytest.mark.parametrize("field,raw", [("temperature", "1e400"), ("temperature", "Infinity"), ("top_p", "NaN"),
                                       ("presence_penalty", "-1e400")])
def test_non_finite_numbers_are_400(client, field, raw):
    body = '{"prompt": "hi", "max_tokens": 2, "' + field + '": ' + raw + '}'
    resp = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert _error(resp)["param"] == field


def test_ints_are_valid_floats_and_assistant_content_may_be_null(client):
    assert _post(client, COMPLETIONS, temperature=1, top_p=1).status_code == 200
    messages = [*MESSAGES, {"role": "assistant", "content": None}, {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "Again?"}]
    assert _post(client, CHAT, messages=messages).status_code == 200
