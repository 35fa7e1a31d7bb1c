"""The server's side of issue 24's engine items, in process (ASGI transport, tiny model):

- a request the engine finished for waiting past ``--timeout-s`` is an OpenAI-shaped 503
  (code "queue_timeout"), or an SSE error event then [DONE] in a stream;
- the HTTP ``traceparent`` reaches the engine's span when tracing is on, and only draws one
  warning when it is off (vLLM's behaviour);
- ``--disable-log-stats`` turns the periodic stats line off.
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pagedllm import EngineArgs, tracing
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai import api_server
from tests.helpers import make_tiny_model

pytestmark = pytest.mark.timeout(300)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def serve(engine_args: EngineArgs) -> tuple[AsyncLLMEngine, httpx.AsyncClient]:
    engine = AsyncLLMEngine(LLMEngine.from_engine_args(engine_args), idle_poll_s=0.05)
    app = api_server.build_app(engine, shutdown_engine=False)
    return engine, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)


def test_queue_timeout_is_a_503_and_an_sse_error(folder):
    """max_num_seqs=1 and a long request in the slot: the next requests wait far past timeout_s."""
    engine, client = serve(EngineArgs(model=folder, dtype="float32", max_model_len=512, max_num_seqs=1,
                                      timeout_s=0.05))

    async def main():
        long = asyncio.create_task(client.post("/v1/completions", json={
            "prompt": "Once", "max_tokens": 400, "ignore_eos": True}))
        while engine.num_running_requests() == 0:
            await asyncio.sleep(0.01)
        full = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
        streamed = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True})
        assert (await long).status_code == 200
        return full, streamed

    try:
        full, streamed = asyncio.run(main())
    finally:
        engine.shutdown()
    assert full.status_code == 503 and full.headers["retry-after"]
    error = full.json()["error"]
    assert error["code"] == "queue_timeout" and "timeout_s" in error["message"]
    events = [line[len("data: "):] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "queue_timeout"


def test_traceparent_header_parents_the_engine_span(folder, monkeypatch):
    exporter = InMemorySpanExporter()
    monkeypatch.setattr(tracing, "otlp_span_exporter", lambda endpoint: exporter)
    engine, client = serve(EngineArgs(model=folder, dtype="float32", max_model_len=512,
                                      otlp_traces_endpoint="http://127.0.0.1:9/v1/traces"))
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01", "authorization": "Bearer secret"}

    async def main():
        return await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, headers=headers)

    try:
        response = asyncio.run(main())
    finally:
        engine.shutdown()  # stops the loop, which shuts the engine (and its tracer) down: spans exported
    assert response.status_code == 200
    (span,) = exporter.get_finished_spans()
    assert span.context.trace_id == int(TRACE_ID, 16) and span.parent.span_id == int(PARENT_SPAN_ID, 16)
    assert span.attributes["gen_ai.request.id"] == response.json()["id"]


def test_traceparent_without_tracing_is_served_with_one_warning(folder, caplog, monkeypatch):
    monkeypatch.setattr(tracing, "_warned_disabled", False)
    engine, client = serve(EngineArgs(model=folder, dtype="float32", max_model_len=512))
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"}

    async def main():
        return [await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, headers=headers)
                for _ in range(2)]

    try:
        with caplog.at_level(logging.WARNING, logger="pagedllm"):
            responses = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [r.status_code for r in responses] == [200, 200]
    assert sum("tracing is off" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("flags, logs", [([], True), (["--disable-log-stats"], False)])
def test_disable_log_stats_turns_the_server_stats_line_off(flags, logs, monkeypatch):
    from pagedllm.entrypoints.cli import build_parser

    seen = {}

    class Started(Exception):
        pass

    def from_engine_args(engine_args, usage_context, **kwargs):
        seen.update(kwargs, disable_log_stats=engine_args.disable_log_stats)
        raise Started

    monkeypatch.setattr(api_server.AsyncLLMEngine, "from_engine_args", staticmethod(from_engine_args))
    ns = build_parser().parse_args(["serve", *flags])
    with pytest.raises(Started):
        api_server.run_server(ns)
    assert seen["log_stats"] is logs and seen["disable_log_stats"] is not logs
