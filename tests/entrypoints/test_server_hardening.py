"""`pagedllm serve` tried as a new user would: one large prompt must not stall everyone, bad input is
a 400 naming the field (never a 500), admission counts only requests that truly wait, and a
SIGTERM past --shutdown-timeout answers in-flight requests in OpenAI's shape.

One server (subprocess, embedded SmolLM2, 32 running slots, 4 waiting) for the module; the last
test stops it with SIGTERM.
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
import pytest

pytestmark = pytest.mark.timeout(300)

MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 32
MAX_WAITING = 4
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
# /health must answer within this while another request's prompt is read, parsed and refused or
# tokenized. The target is 100 ms; CI runs on 2 shared cores where the server's event loop, its
# engine thread, a tokenizer thread and this test's client compete, and a 5 MB JSON parse alone
# takes ~30 ms there. Before the fix the stall was seconds (3.9 s idle, 20 s busy), so 250 ms
# still tells the two apart by an order of magnitude.
HEALTH_BOUND_S = 0.25


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_cmd(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-waiting-requests", str(MAX_WAITING), "--kv-cache-memory", str(256 * 2**20),
            "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", *extra]


class Server:
    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        env = dict(ENV)
        env.pop("PAGEDLLM_API_KEY", None)
        self.proc = subprocess.Popen(_serve_cmd(self.port, "--shutdown-timeout", "1"), stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(self.output())

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
        yield srv
    finally:
        srv.stop()


def _post(server, path: str, content: str | bytes, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=timeout)


def _error(resp: httpx.Response, status: int, param: str | None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err


def _health_latencies_while(server, send) -> tuple[list[float], object]:
    """Call ``send()`` on a thread and time /health every 20 ms until it returns."""
    result: list = []
    t = threading.Thread(target=lambda: result.append(send()))
    latencies = []
    with httpx.Client(timeout=30) as http:
        http.get(server.url + "/health")  # the connection is open before the clock starts
        t.start()
        while t.is_alive() or not latencies:
            t0 = time.perf_counter()
            assert http.get(server.url + "/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.02)
    t.join()
    return latencies, result[0]


# -- one large prompt does not stall everyone ---------------------------------------------------------
def test_a_5mb_prompt_is_refused_without_stalling_health(server):
    body = json.dumps({"prompt": "hello world " * (5 * 2**20 // 12), "max_tokens": 4})
    latencies, resp = _health_latencies_while(server, lambda: _post(server, "/v1/completions", body))
    err = _error(resp, 413, None)
    assert "--max-request-body-bytes" in err["message"]
    assert max(latencies) < HEALTH_BOUND_S, latencies


def test_an_over_long_prompt_under_the_body_cap_is_refused_before_tokenizing(server):
    body = json.dumps({"prompt": "hello world " * (3 * 2**20 // 12), "max_tokens": 4})
    latencies, resp = _health_latencies_while(server, lambda: _post(server, "/v1/completions", body))
    err = _error(resp, 400, "prompt")
    assert err["code"] == "context_length_exceeded" and "characters" in err["message"]
    assert max(latencies) < HEALTH_BOUND_S, latencies


def test_a_long_chat_is_tokenized_off_the_event_loop(server):
    # A chat's rendered text is not length-checked (a template may drop content): it is rendered
    # and tokenized on a tokenizer thread, ~1 s here, while /health keeps answering.
    content = "hello world " * (3 * 2**20 // 12)
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 4})
    latencies, resp = _health_latencies_while(server, lambda: _post(server, "/v1/chat/completions", body))
    assert _error(resp, 400, "messages")["code"] == "context_length_exceeded"
    assert max(latencies) < HEALTH_BOUND_S, latencies


def test_a_chunked_body_is_cut_at_the_limit(server):
    sent = 0

    def chunks():  # no Content-Length: the server must count as the bytes arrive
        nonlocal sent
        for _ in range(2000):
            sent += 10_000
            yield b"x" * 10_000

    resp = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60)
    _error(resp, 413, None)


# -- bad input is a 400 naming the field -------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "hi \\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud83d"]}', "stop"),
    ("/v1/completions", '{"prompt": "hi", "logit_bias": ' + "[" * 100_000 + "]" * 100_000 + "}", "logit_bias"),
    ("/v1/completions", '{"prompt": "hi", "stop": ' + "[" * 200 + "]" * 200 + "}", "stop"),
    ("/v1/completions", "[" * 100_000 + "]" * 100_000, None),
])
def test_bad_unicode_and_deep_nesting_are_400_naming_the_field(server, path, body, param):
    _error(_post(server, path, body), 400, param)


# -- admission: only requests that truly wait count ---------------------------------------------------
def test_a_burst_fills_the_free_slots_before_anything_counts_as_waiting(server):
    """40 requests to an idle server with 32 free slots and 4 waiting places: at most 4 refused."""
    async def main():
        async with httpx.AsyncClient(timeout=240, limits=httpx.Limits(max_connections=100)) as http:
            async def one(i: int) -> httpx.Response:
                return await http.post(server.url + "/v1/completions", json={
                    "prompt": f"Count to {i}", "max_tokens": 4, "ignore_eos": True})
            return await asyncio.gather(*[one(i) for i in range(MAX_NUM_SEQS + 8)])

    codes = [r.status_code for r in asyncio.run(main())]
    assert set(codes) <= {200, 503}
    assert codes.count(200) >= MAX_NUM_SEQS + MAX_WAITING, codes


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": ["hi"] * (MAX_NUM_SEQS + MAX_WAITING + 1), "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["hi"] * 20, "n": 2, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": MAX_NUM_SEQS + MAX_WAITING + 1, "max_tokens": 2}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": MAX_NUM_SEQS + MAX_WAITING + 1,
                              "max_tokens": 2}, "n"),
])
def test_a_request_that_can_never_fit_is_400_not_503(server, path, body, param):
    _error(_post(server, path, json.dumps(body)), 400, param)


def test_a_request_that_fits_an_idle_server_is_admitted(server):
    body = {"prompt": ["hi"] * (MAX_NUM_SEQS + MAX_WAITING), "max_tokens": 2}
    assert _post(server, "/v1/completions", json.dumps(body)).status_code == 200


# -- last: SIGTERM past --shutdown-timeout -----------------------------------------------------------
def test_sigterm_past_the_timeout_answers_503_and_ends_streams_with_done(server):
    long = {"prompt": "Once upon a time", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True}
    plain: list[httpx.Response] = []
    events: list[str] = []
    started = threading.Event()

    def non_stream() -> None:
        plain.append(_post(server, "/v1/completions", json.dumps(long)))

    def stream() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    started.set()

    threads = [threading.Thread(target=non_stream), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    assert started.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert server.proc.wait(60) == 0, server.output()
    err = _error(plain[0], 503, None)
    assert err["code"] == "server_shutting_down"
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down", events[-3:]
