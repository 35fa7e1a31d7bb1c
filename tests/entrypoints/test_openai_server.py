"""`pagedllm serve` end to end: a real server (subprocess, loopback port, embedded SmolLM2) driven by
the official openai client (sync, async, streaming) and raw HTTP for what the client hides.

One server for the whole module; the last test stops it with SIGTERM and checks the exit status.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(300)

API_KEY = "test-key"
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 64
MAX_WAITING = 64
PROMPT = "The capital of France is"
CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}, {"type": "text", "text": "One word."}]},
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("PAGEDLLM_API_KEY", None)
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING),
               "--kv-cache-memory", str(256 * 2**20), "--uvicorn-log-level", "warning",
               "--disable-uvicorn-access-log", "--shutdown-timeout", "2", "--stats-log-interval", "1"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()
        os.unlink(self.log.name)


@pytest.fixture(scope="module")
def server():
    srv = Server()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def _metrics(server) -> dict[tuple, float]:
    text = httpx.get(server.url + "/metrics", headers=_auth(), timeout=10).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _wait_idle(server, timeout: float = 30.0) -> dict:
    """Poll /metrics until nothing runs or waits and no KV block is held."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(server)
        if (m[("pagedllm:num_requests_running", ())] == 0 and m[("pagedllm:num_requests_waiting", ())] == 0
                and m[("pagedllm:kv_cache_usage_perc", ())] == 0):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout} s: {m}")
        time.sleep(0.05)


# -- the basics --------------------------------------------------------------------------------------
def test_models_health_version(server, client, model):
    assert model == "SmolLM2-135M-Instruct"
    models = client.models.list().data
    assert models[0].object == "model"
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version", headers=_auth()).json()["version"]
    assert client.models.retrieve(model).id == model  # GET /v1/models/{id}
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


def test_completion_stream_equals_non_stream(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    text = full.choices[0].text
    assert full.object == "text_completion" and text and full.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_chat_stream_equals_non_stream(client, model):
    full = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0)
    msg = full.choices[0].message
    assert full.object == "chat.completion" and msg.role == "assistant" and msg.content
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_async_client_stream_and_non_stream(server, model):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        full = await aclient.chat.completions.create(model=model, messages=CHAT[:2], max_tokens=8, temperature=0)
        stream = await aclient.chat.completions.create(model=model, messages=CHAT[:2], max_tokens=8,
                                                       temperature=0, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await aclient.close()
        return full.choices[0].message.content, text

    a, b = asyncio.run(main())
    assert a == b and a


def test_n2(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2, temperature=1.0, seed=1,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 12
    chat = client.chat.completions.create(model=model, messages=CHAT[:2], max_tokens=5, n=2, temperature=1.0,
                                          seed=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage.completion_tokens == 10
    stream = client.chat.completions.create(model=model, messages=CHAT[:2], max_tokens=5, n=2, temperature=1.0,
                                            stream=True, extra_body={"ignore_eos": True})
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in stream
                if c.choices and c.choices[0].finish_reason}
    assert finishes == {0: "length", 1: "length"}


def test_seed_makes_sampling_repeatable(client, model):
    kw = dict(model=model, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=1234)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_completion_logprobs(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 3 <= len(top) <= 4
        assert top[tok] == val and max(top.values()) == val  # greedy: the chosen token is the top one
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat_logprobs(client, model):
    out = client.chat.completions.create(model=model, messages=CHAT[:2], max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5 == out.usage.completion_tokens
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
    chunks = list(client.chat.completions.create(model=model, messages=CHAT[:2], max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=1, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in content]


def test_stop_strings(client, model):
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    words = base.split()
    assert len(words) >= 3, base
    stop = " " + words[2]
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == base[: base.index(stop)]
    assert out.choices[0].model_extra.get("stop_reason") == stop
    kept = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == base[: base.index(stop) + len(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop], stream=True) if c.choices)
    assert streamed == out.choices[0].text


def test_usage_counts(server, client, model):
    n_prompt = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, headers=_auth()).json()["count"]
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (n_prompt, 7, n_prompt + 7)
    n_chat = httpx.post(server.url + "/tokenize", json={"messages": CHAT}, headers=_auth()).json()["count"]
    chat = client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (n_chat, 4)


def test_include_usage(client, model):
    for create, kw in ((client.completions.create, {"prompt": PROMPT}), (client.chat.completions.create,
                                                                       {"messages": CHAT[:2]})):
        chunks = list(create(model=model, max_tokens=5, temperature=0, stream=True,
                             stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **kw))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
        assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5
        assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=3, stream=True))
    assert all(c.usage is None and c.choices for c in plain)


def test_vllm_extra_body_fields(client, model):
    extra = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "ignore_eos": True, "min_tokens": 3,
             "stop_token_ids": [2], "skip_special_tokens": True, "include_stop_str_in_output": False, "priority": 1}
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0.7, top_p=0.9,
                                    presence_penalty=0.5, frequency_penalty=0.5, seed=3, extra_body=extra)
    assert out.usage.completion_tokens == 4
    chat = client.chat.completions.create(model=model, messages=CHAT[:2], max_tokens=4, temperature=0.7,
                                          extra_body=extra)
    assert chat.usage.completion_tokens == 4


def test_batched_prompts_and_token_prompts(server, client, model):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, headers=_auth()).json()["tokens"]
    out = client.completions.create(model=model, prompt=[PROMPT, "Hello"], max_tokens=3, temperature=0, n=2,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3] and out.usage.completion_tokens == 12
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    echo = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text.startswith(PROMPT)


def test_chat_template_override(server, client, model):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    tok = httpx.post(server.url + "/tokenize", json={"messages": CHAT[:2], "chat_template": template}, headers=_auth()).json()
    expected = "<system>You are a concise assistant.\n<user>What is the capital of France?\n<assistant>"
    assert httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}, headers=_auth()).json()["prompt"] == expected
    out = client.chat.completions.create(model=model, messages=CHAT[:2], max_tokens=3, temperature=0,
                                         extra_body={"chat_template": template, "ignore_eos": True})
    assert out.usage.prompt_tokens == tok["count"]


def test_tokenize_detokenize(server):
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, headers=_auth()).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    assert httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}, headers=_auth()).json()["prompt"] == "Hello world"
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}, headers=_auth())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# -- errors ------------------------------------------------------------------------------------------
def _post(server, path: str, body, headers=None) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={**_auth(), **(headers or {})}, timeout=60)


def _assert_error(resp: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "any":
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 3', None),  # malformed JSON
    ("/v1/completions", "[1, 2]", None),  # not an object
    ("/v1/completions", {"max_tokens": 3}, "prompt"),  # missing field
    ("/v1/completions", {"prompt": "hi", "max_tokens": "three"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 1.5}, "n"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 1000}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, "top_k"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"prompt": "hi " * (MAX_MODEL_LEN + 10)}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN * 2}, "max_tokens"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 99}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * (MAX_MODEL_LEN + 10)}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                          "image_url": {"url": "x"}}]}]}, "messages"),
])
def test_bad_requests_are_400_naming_the_field(server, path, body, param):
    _assert_error(_post(server, path, body), 400, param)


def test_errors_through_the_openai_client(server, client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hi", temperature=5.0, top_p=-1)
    assert e.value.body["param"] in ("temperature", "top_p")
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT[:2], max_tokens=2)
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=model, prompt="hi", max_tokens=2)


def test_api_key_guards_every_route_but_health(server):
    for path in ("/v1/models", "/metrics", "/version", "/docs", "/openapi.json"):
        _assert_error(httpx.get(server.url + path), 401)
        _assert_error(httpx.get(server.url + path, headers={"Authorization": "Bearer nope"}), 401)
        assert httpx.get(server.url + path, headers=_auth()).status_code == 200
    for path in ("/v1/completions", "/tokenize", "/detokenize"):
        _assert_error(httpx.post(server.url + path, json={"prompt": "hi"}), 401)
    # The scheme is case-insensitive (RFC 9110); the key is not.
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200
    _assert_error(httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY.upper()}x"}), 401)
    assert httpx.get(server.url + "/health").status_code == 200
    _assert_error(httpx.get(server.url + "/no/such/route", headers=_auth()), 404)


def test_server_survives_garbage(server, client, model):
    for body in (b"\xff\xfe\x00", b"", b"null", b'{"prompt": null}', b'{"prompt": "hi", "stream": "yes please"}'):
        resp = _post(server, "/v1/completions", body, headers={"Content-Type": "application/json"})
        assert resp.status_code == 400, (body, resp.text)
    assert client.completions.create(model=model, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


# -- disconnects, concurrency, overload, metrics ----------------------------------------------------
def test_disconnect_mid_stream_frees_blocks(server):
    before = _wait_idle(server)
    aborted_key = ("pagedllm:request_success_total", (("finished_reason", "abort"),))
    body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", server.url + "/v1/completions", json=body,
                                                       headers=_auth()) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break
        m = _metrics(server)
        assert m[("pagedllm:num_requests_running", ())] == 1 and m[("pagedllm:kv_cache_usage_perc", ())] > 0
    after = _wait_idle(server, timeout=10)  # the blocks came back: nothing held any more
    assert after.get(aborted_key, 0) == before.get(aborted_key, 0) + 1


def test_disconnect_while_waiting_for_a_non_stream_response(server):
    before = _wait_idle(server)
    aborted_key = ("pagedllm:request_success_total", (("finished_reason", "abort"),))
    body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=_auth(), timeout=httpx.Timeout(10, read=1.0))
    after = _wait_idle(server, timeout=10)
    assert after.get(aborted_key, 0) == before.get(aborted_key, 0) + 1


def test_64_concurrent_async_requests_complete_exactly(server, model):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=240)

        async def one(i: int) -> int:
            max_tokens = 4 + i % 5
            if i % 2:
                out = await aclient.completions.create(model=model, prompt=f"{PROMPT} {i}", max_tokens=max_tokens,
                                                       temperature=0.8, extra_body={"ignore_eos": True})
                assert out.choices[0].finish_reason == "length"
                return out.usage.completion_tokens - max_tokens
            stream = await aclient.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Count to {i}"}], max_tokens=max_tokens,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            chunks = [c async for c in stream]
            return chunks[-1].usage.completion_tokens - max_tokens

        diffs = await asyncio.gather(*[one(i) for i in range(64)])
        await aclient.close()
        return diffs

    assert asyncio.run(main()) == [0] * 64
    _wait_idle(server)


def test_overload_is_503_with_retry_after(server, model):
    async def main():
        async with httpx.AsyncClient(timeout=240, limits=httpx.Limits(max_connections=400)) as http:
            async def one(i: int) -> httpx.Response:
                return await http.post(server.url + "/v1/completions", headers=_auth(), json={
                    "model": model, "prompt": f"{PROMPT} {i}", "max_tokens": 8, "ignore_eos": True})
            return await asyncio.gather(*[one(i) for i in range(MAX_NUM_SEQS + MAX_WAITING + 100)])

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}
    assert codes.count(503) > 0 and codes.count(200) >= MAX_NUM_SEQS
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "overloaded_error"
        else:
            assert r.json()["usage"]["completion_tokens"] == 8
    _wait_idle(server)


def test_metrics_parse_and_names(server):
    text = httpx.get(server.url + "/metrics", headers=_auth()).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:kv_cache_usage_perc",
                 "pagedllm:prefix_cache_queries", "pagedllm:prefix_cache_hits", "pagedllm:prompt_tokens",
                 "pagedllm:generation_tokens", "pagedllm:request_success", "pagedllm:time_to_first_token_seconds",
                 "pagedllm:inter_token_latency_seconds", "pagedllm:e2e_request_latency_seconds",
                 "pagedllm:request_queue_time_seconds", "pagedllm:num_preemptions"):
        assert name in families, name
    m = _metrics(server)
    assert m[("pagedllm:generation_tokens_total", ())] > 0
    assert m[("pagedllm:prompt_tokens_total", ())] > 0
    assert m[("pagedllm:prefix_cache_hits_total", ())] > 0  # the same prompts came many times
    assert m[("pagedllm:request_success_total", (("finished_reason", "length"),))] >= 64
    assert m[("pagedllm:time_to_first_token_seconds_count", ())] >= 64
    assert m[("pagedllm:request_queue_time_seconds_count", ())] >= 64
    assert "Avg generation throughput" in server.output()  # the periodic log line


def test_bench_serve_against_the_server(server, tmp_path):
    from pagedllm.entrypoints.cli import build_parser

    out = tmp_path / "serve.json"
    ns = build_parser().parse_args(["bench", "serve", "--port", str(server.port), "--api-key", API_KEY,
                                    "--num-prompts", "6", "--input-len", "8", "32", "--output-len", "4", "8",
                                    "--max-concurrency", "3", "--request-rate", "50", "--output-json", str(out)])
    assert ns.func(ns) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == result["expected_output_tokens"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert set(result[key]) == {"mean", "p50", "p90", "p99"}
    assert result["output_throughput"] > 0 and result["request_throughput"] > 0


# -- last: graceful shutdown -------------------------------------------------------------------------
def test_sigterm_graceful_shutdown_exits_0(server):
    received: list[str] = []
    first = threading.Event()

    def stream_one() -> None:
        body = {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=_auth(),
                              timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        received.append(line)
                        first.set()
        except httpx.HTTPError as e:
            received.append(f"error: {e}")
        first.set()

    t = threading.Thread(target=stream_one)
    t.start()
    assert first.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0, server.output()
    t.join(30)
    assert not t.is_alive()
    assert received  # the in-flight stream got output and then ended (finished or aborted)
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url + "/health", timeout=2)
