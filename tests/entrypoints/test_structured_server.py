"""Structured output and tool calling through the server, driven by the official ``openai`` client.

In process: ``build_app`` around an AsyncLLMEngine on the embedded SmolLM2, served by starlette's
TestClient, which the ``openai`` client uses as its HTTP client. Every output is validated
(jsonschema, ``re.fullmatch``, membership); bad constraints are 400s naming the field the client
used, and leave the engine whole (block-pool integrity, no matcher left). The 135M model does not
call tools on its own, so ``tool_choice='auto'`` is driven end to end by a regex that makes it
write a hermes ``<tool_call>`` block, which the auto parser then reads.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import openai
import pytest
from starlette.testclient import TestClient

from pagedllm.config import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.chat_utils import apply_chat_template
from pagedllm.entrypoints.openai.api_server import build_app
from tests.helpers import has_default_model

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow,
              pytest.mark.skipif(not has_default_model(), reason="embedded SmolLM2 not installed")]

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                      "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["yes", "no"]
GRAMMAR = 'root ::= "yes" | "no" | ("maybe " [0-9])'
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
PROMPT = "A person described as JSON:"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                       "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# A hermes tool call the regex makes the model write (for tool_choice auto / none).
HERMES_CALL = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'


def _literal(text: str) -> str:
    """A regex matching exactly ``text`` (xgrammar warns about Python's escaped spaces)."""
    return re.escape(text).replace("\\ ", " ")


@pytest.fixture(scope="module")
def served():
    llm_engine = LLMEngine.from_engine_args(EngineArgs(max_model_len=512, max_num_seqs=8,
                                                       kv_cache_memory=64 * 2**20))
    engine = AsyncLLMEngine(llm_engine, log_stats=False)
    with TestClient(build_app(engine, max_waiting_requests=None)) as http:
        yield llm_engine, http


@pytest.fixture(scope="module")
def http(served):
    return served[1]


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def _assert_engine_whole(llm_engine: LLMEngine, timeout: float = 30.0) -> None:
    """Once nothing runs: every KV block free, the scheduler's invariants hold, no matcher left
    but those the next step releases."""
    core = llm_engine.engine_core
    deadline = time.monotonic() + timeout
    while core.scheduler.requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not core.scheduler.requests
    core.scheduler.check_integrity()
    pool = core.scheduler.kv_cache_manager.block_pool
    assert all(block.ref_cnt == 0 for block in pool.blocks), "a KV block is still held"
    grammars = core.structured_output
    if grammars is not None:  # matchers of finished requests go with the next step's finished ids
        assert set(grammars._requests) <= core.scheduler.finished_req_ids, "a matcher leaked"


def _chat(client, stream: bool, **kwargs) -> tuple[str | None, list[dict], str]:
    """(content, tool_calls, finish_reason) of choice 0; a stream is put back together as a client would."""
    if not stream:
        choice = client.chat.completions.create(model="", temperature=0, **kwargs).choices[0]
        calls = [c.model_dump(include={"id", "type", "function"}) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = None, {}, None
    for chunk in client.chat.completions.create(model="", temperature=0, stream=True, **kwargs):
        choice = chunk.choices[0]
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for call in choice.delta.tool_calls or []:
            if call.index not in calls:  # the first chunk of a call: its id, type and name
                assert call.id.startswith("chatcmpl-tool-") and call.function.name, call
                assert call.index == len(calls)
                calls[call.index] = {"id": call.id, "type": call.type,
                                     "function": {"name": call.function.name, "arguments": ""}}
            else:
                assert call.id is None and call.function.name is None, call
            calls[call.index]["function"]["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in range(len(calls))], finish


def _completion(client, stream: bool, **kwargs) -> tuple[str, str]:
    if "response_format" in kwargs:  # the client declares it for chat only
        kwargs["extra_body"] = {**kwargs.get("extra_body", {}), "response_format": kwargs.pop("response_format")}
    if not stream:
        choice = client.completions.create(model="", prompt=PROMPT, temperature=0, **kwargs).choices[0]
        return choice.text, choice.finish_reason
    chunks = list(client.completions.create(model="", prompt=PROMPT, temperature=0, stream=True, **kwargs))
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


# -- every constraint kind, both endpoints, stream and not --------------------------------------------
def _json_schema_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                                        "strict": True}}}


def _valid_person(text: str) -> bool:
    jsonschema.validate(json.loads(text), PERSON)
    return True


CONSTRAINTS = [  # (id, request fields, check of the text)
    ("response_format-json_schema", _json_schema_format(PERSON), _valid_person),
    ("guided_json", {"extra_body": {"guided_json": PERSON}}, _valid_person),
    ("structured_outputs-json", {"extra_body": {"structured_outputs": {"json": json.dumps(PERSON),
                                                                       "disable_any_whitespace": True}}},
     lambda text: _valid_person(text) and "\n" not in text),  # xgrammar's compact form: no free whitespace
    ("guided_regex", {"extra_body": {"guided_regex": REGEX}}, lambda text: re.fullmatch(REGEX, text)),
    ("structured_outputs-regex", {"extra_body": {"structured_outputs": {"regex": REGEX}}},
     lambda text: re.fullmatch(REGEX, text)),
    ("guided_choice", {"extra_body": {"guided_choice": CHOICES, "guided_decoding_backend": "xgrammar"}},
     lambda text: text in CHOICES),
    ("structured_outputs-choice", {"extra_body": {"structured_outputs": {"choice": CHOICES}}},
     lambda text: text in CHOICES),
    ("guided_grammar", {"extra_body": {"guided_grammar": GRAMMAR}}, lambda text: re.fullmatch(r"yes|no|maybe [0-9]", text)),
    ("structured_outputs-grammar", {"extra_body": {"structured_outputs": {"grammar": GRAMMAR}}},
     lambda text: re.fullmatch(r"yes|no|maybe [0-9]", text)),
]


@pytest.mark.parametrize("name,fields,check", CONSTRAINTS, ids=[c[0] for c in CONSTRAINTS])
def test_every_constraint_kind_on_chat_and_completions(client, name, fields, check):
    """Each kind on both endpoints, streamed on one of them (alternating, to keep the test short)."""
    stream = CONSTRAINTS.index(next(c for c in CONSTRAINTS if c[0] == name)) % 2 == 1
    content, calls, finish = _chat(client, stream, messages=ASK, max_tokens=40, **fields)
    assert finish == "stop" and not calls and check(content), (content, finish)
    text, finish = _completion(client, not stream, max_tokens=40, **fields)
    assert finish == "stop" and check(text), (text, finish)


def _json_object_or_its_start(text: str, finish: str) -> bool:
    if finish == "stop":
        return isinstance(json.loads(text), dict)
    return finish == "length" and text.lstrip().startswith("{")  # cut by max_tokens


def test_json_object_gives_a_json_object(client):
    """{"type": "json_object"}: any JSON object (the model's may outgrow a short max_tokens)."""
    content, _, finish = _chat(client, True, messages=ASK, max_tokens=24, response_format={"type": "json_object"})
    assert _json_object_or_its_start(content, finish), (content, finish)
    text, finish = _completion(client, False, max_tokens=24, extra_body={"structured_outputs": {"json_object": True}})
    assert _json_object_or_its_start(text, finish), (text, finish)


# -- bad constraints ----------------------------------------------------------------------------------
BAD = [  # (endpoint, fields, the param the 400 names)
    ("chat", {"guided_json": "{not json"}, "guided_json"),
    ("chat", {"guided_regex": "(unclosed"}, "guided_regex"),
    ("completions", {"guided_grammar": "root ::= "}, "guided_grammar"),
    ("completions", {"guided_choice": []}, "guided_choice"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
     "response_format"),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format"),
    ("chat", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("chat", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ("chat", {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
    ("chat", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("completions", {"response_format": {"type": "json_object"}, "guided_json": PERSON}, "guided_json"),
    ("chat", {"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("chat", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("completions", {"guided_regex": "a", "use_beam_search": True, "n": 2}, "guided_regex"),
    ("chat", {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "bogus"}}}}}], "tool_choice": "required"}, "tools"),
    ("chat", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("chat", {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tools": [{"type": "function"}]}, "tools"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
]


@pytest.mark.parametrize("endpoint,fields,param", BAD, ids=[f"{b[0]}-{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_constraints_are_400_naming_the_field(served, endpoint, fields, param):
    llm_engine, http = served
    base = {"messages": ASK} if endpoint == "chat" else {"prompt": PROMPT}
    resp = http.post(f"/v1/{'chat/' if endpoint == 'chat' else ''}completions",
                     json={**base, "max_tokens": 4, **fields})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    assert "Traceback" not in error["message"] and "/project/" not in error["message"]
    _assert_engine_whole(llm_engine)


def test_the_server_still_serves_after_bad_constraints(served, client):
    llm_engine, _ = served
    content, _, finish = _chat(client, False, messages=ASK, max_tokens=8, extra_body={"guided_choice": CHOICES})
    assert content in CHOICES and finish == "stop"
    _assert_engine_whole(llm_engine)


# -- tool calling -------------------------------------------------------------------------------------
def _check_calls(calls: list[dict]) -> None:
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_required_tool_choice_always_calls_a_tool_and_its_stream_reassembles(client):
    fields = dict(messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=60)
    whole, streamed = _chat(client, False, **fields), _chat(client, True, **fields)
    for content, calls, finish in (whole, streamed):
        assert content is None and finish == "tool_calls" and calls, (content, calls, finish)
        _check_calls(calls)
    assert len({c["id"] for c in whole[1] + streamed[1]}) == len(whole[1]) + len(streamed[1])  # fresh ids
    assert [c["function"] for c in whole[1]] == [c["function"] for c in streamed[1]]


def test_required_without_parallel_calls_makes_one_call(client):
    """The greedy reply calls get_weather twice when it may (see above); here once."""
    content, calls, finish = _chat(client, False, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False, max_tokens=40)
    assert content is None and finish == "tool_calls" and len(calls) == 1, calls
    _check_calls(calls)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_named_tool_choice_calls_that_function(client, stream):
    content, calls, finish = _chat(client, stream, messages=QUESTION, tools=TOOLS, max_tokens=30,
                                   tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert content is None and finish == "tool_calls" and [c["function"]["name"] for c in calls] == ["get_time"]
    _check_calls(calls)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_auto_reads_the_models_hermes_call(client, stream):
    """The regex makes the model write a hermes block; the auto parser (from the template) reads it."""
    content, calls, finish = _chat(client, stream, messages=QUESTION, tools=TOOLS, max_tokens=40,
                                   extra_body={"guided_regex": _literal(HERMES_CALL)})
    assert content is None and finish == "tool_calls", (content, calls, finish)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_time", {"tz": "UTC"})]


def test_auto_keeps_text_around_a_call_and_plain_replies_as_content(client):
    regex = _literal("Sure. " + HERMES_CALL)
    content, calls, finish = _chat(client, False, messages=QUESTION, tools=TOOLS, tool_choice="auto",
                                   max_tokens=40, extra_body={"guided_regex": regex})
    assert content == "Sure. " and len(calls) == 1 and finish == "tool_calls"
    content, calls, finish = _chat(client, False, messages=QUESTION, tools=TOOLS, max_tokens=5)
    assert content and not calls and finish in ("stop", "length")


def test_auto_without_parallel_calls_keeps_the_first(client):
    regex = _literal(HERMES_CALL + HERMES_CALL.replace("UTC", "CET"))
    for stream in (False, True):
        _, calls, _ = _chat(client, stream, messages=QUESTION, tools=TOOLS, parallel_tool_calls=False,
                            max_tokens=60, extra_body={"guided_regex": regex})
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"tz": "UTC"}]


def test_tool_choice_none_leaves_the_text_as_content(client):
    content, calls, finish = _chat(client, False, messages=QUESTION, tools=TOOLS, tool_choice="none",
                                   max_tokens=40, extra_body={"guided_regex": _literal(HERMES_CALL)})
    assert content == HERMES_CALL and not calls and finish == "stop"


# -- the chat template: tools, a tool-result turn, chat_template_kwargs ----------------------------------
FOLLOW_UP = QUESTION + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "chatcmpl-tool-1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "18 C, sunny"},
]


def test_tools_and_a_tool_result_turn_reach_smollm2s_plain_template(served, client):
    """SmolLM2's template renders neither tools nor tool calls: the tools go to the system prompt
    and the call and its result are rendered as hermes text."""
    llm_engine, http = served
    text = llm_engine.get_tokenizer().decode(apply_chat_template(llm_engine.get_tokenizer(), FOLLOW_UP,
                                                                 tools=TOOLS))
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>tool\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    counted = http.post("/tokenize", json={"messages": FOLLOW_UP, "tools": TOOLS}).json()["count"]
    reply = client.chat.completions.create(model="", messages=FOLLOW_UP, tools=TOOLS, max_tokens=3, temperature=0)
    assert reply.usage.prompt_tokens == counted and reply.choices[0].message.content


def test_a_template_that_reads_tools_gets_them(http):
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}: "
                "{{ m.content }}{% for c in m.tool_calls or [] %} CALL {{ c.function.name }}{{ c.function.arguments.city }}"
                "{% endfor %}{{ '\\n' }}{% endfor %}")
    body = {"messages": FOLLOW_UP, "tools": TOOLS, "chat_template": template, "return_token_strs": True}
    ids = http.post("/tokenize", json=body).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == ("[get_weather][get_time]user: What is the weather in Paris?\nassistant:  CALL get_weatherParis\n"
                    "tool: 18 C, sunny\n")


def test_chat_template_kwargs_reach_the_template(http):
    template = "{{ greeting }} {{ messages[0]['content'] }}"
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": template,
            "chat_template_kwargs": {"greeting": "Bonjour"}, "max_tokens": 1}
    ids = http.post("/tokenize", json=body).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "Bonjour hi"
    reply = http.post("/v1/chat/completions", json=body).json()
    assert reply["usage"]["prompt_tokens"] == len(ids)


def test_a_tool_message_needs_its_call_id(http):
    messages = QUESTION + [{"role": "tool", "content": "18 C"}]
    resp = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    assert "tool_call_id" in resp.json()["error"]["message"]


def test_beam_search_keeps_the_tools_in_the_prompt_with_tool_choice_none(http):
    body = {"messages": QUESTION, "use_beam_search": True, "n": 2, "max_tokens": 2}
    plain = http.post("/v1/chat/completions", json=body)
    with_tools = http.post("/v1/chat/completions", json={**body, "tools": TOOLS, "tool_choice": "none"})
    assert plain.status_code == with_tools.status_code == 200, with_tools.text
    assert with_tools.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"]
    refused = http.post("/v1/chat/completions", json={**body, "tools": TOOLS})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
