"""OpenTelemetry tracing: one ``llm_request`` span per finished request, parented on the W3C
``traceparent`` of its trace_headers, with vLLM's attributes and the RequestMetrics' times; the
span exporter is OpenTelemetry's in-memory one here (OTLP/HTTP in production). Without an
endpoint, trace_headers are refused by name and nothing of opentelemetry is imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from pagedllm import EngineArgs, SamplingParams, tracing
from pagedllm.engine.llm_engine import LLMEngine
from tests.helpers import make_tiny_model

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def traced(folder):
    """An engine exporting to an in-memory exporter (the OTLP exporter is swapped out)."""
    exporter = InMemorySpanExporter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tracing, "otlp_span_exporter", lambda endpoint: exporter)
        engine = LLMEngine.from_engine_args(EngineArgs(model=folder, dtype="float32", max_model_len=256,
                                                       otlp_traces_endpoint="http://127.0.0.1:9/v1/traces"))
    yield engine, exporter
    engine.shutdown()


def run(engine: LLMEngine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    engine.tracer.force_flush()
    return finished


def test_span_is_parented_on_traceparent_with_vllm_attributes(traced):
    engine, exporter = traced
    exporter.clear()
    params = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, n=2, seed=1, ignore_eos=True)
    engine.add_request("traced-1", {"prompt_token_ids": list(range(20, 32))}, params,
                       trace_headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1"})
    out = run(engine)["traced-1"]
    (span,) = exporter.get_finished_spans()
    assert span.name == "llm_request" and span.kind == SpanKind.SERVER
    assert span.context.trace_id == int(TRACE_ID, 16)
    assert span.parent is not None and span.parent.span_id == int(PARENT_SPAN_ID, 16) and span.parent.is_remote
    m = out.metrics
    assert span.start_time == int(m.arrival_time * 1e9) and span.end_time == int(m.finished_time * 1e9)
    a = span.attributes
    assert a["gen_ai.request.id"] == "traced-1"
    assert a["gen_ai.usage.prompt_tokens"] == 12
    assert a["gen_ai.usage.completion_tokens"] == 10  # 2 sequences x 5 tokens
    assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.n"] == 2
    assert a["gen_ai.request.temperature"] == pytest.approx(0.7) and a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.latency.time_in_queue"] == pytest.approx(m.time_in_queue)
    assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(m.first_token_time - m.arrival_time)
    assert a["gen_ai.latency.e2e"] == pytest.approx(m.finished_time - m.arrival_time)
    assert a["gen_ai.latency.time_in_model_prefill"] == pytest.approx(m.first_token_time - m.first_scheduled_time)
    assert a["gen_ai.latency.time_in_model_decode"] == pytest.approx(m.last_token_time - m.first_token_time)
    assert a["gen_ai.latency.time_in_model_inference"] == pytest.approx(m.last_token_time - m.first_scheduled_time)
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length", "length")


def test_requests_without_trace_headers_and_aborted_ones_get_root_spans(traced):
    engine, exporter = traced
    exporter.clear()
    engine.add_request("plain", "Hello", SamplingParams(max_tokens=2))
    engine.add_request("gone", "Hello", SamplingParams(max_tokens=2), trace_headers={"traceparent": TRACEPARENT})
    engine.abort_request("gone")
    run(engine)
    spans = {s.attributes["gen_ai.request.id"]: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"plain", "gone"}
    assert spans["plain"].parent is None
    assert spans["gone"].parent.span_id == int(PARENT_SPAN_ID, 16)
    assert tuple(spans["gone"].attributes["gen_ai.response.finish_reasons"]) == ("abort",)
    assert "gen_ai.latency.time_in_queue" not in spans["gone"].attributes  # never scheduled


def test_bad_trace_headers_are_refused_by_name(traced):
    engine, _ = traced
    with pytest.raises(TypeError, match="^trace_headers"):
        engine.add_request("bad", "Hello", SamplingParams(max_tokens=2), trace_headers=[("traceparent", "x")])
    assert not engine.has_unfinished_requests()


def test_the_production_exporter_is_otlp_over_http():
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    exporter = tracing.otlp_span_exporter("http://127.0.0.1:9/v1/traces")
    assert isinstance(exporter, OTLPSpanExporter)
    exporter.shutdown()


def test_extract_trace_headers_keeps_only_w3c_context():
    headers = {"Traceparent": TRACEPARENT, "tracestate": "a=1", "authorization": "Bearer x"}
    assert tracing.extract_trace_headers(headers) == {"traceparent": TRACEPARENT, "tracestate": "a=1"}


def test_without_an_endpoint_trace_headers_are_refused_and_otel_is_never_imported(folder):
    """In a fresh interpreter: an engine without otlp_traces_endpoint refuses trace_headers by name,
    serves requests, and never imports opentelemetry; the server's module imports no SDK or exporter
    (FastAPI itself imports the opentelemetry API package when it is installed)."""
    code = textwrap.dedent(f"""
        import sys
        from pagedllm import EngineArgs, SamplingParams
        from pagedllm.engine.llm_engine import LLMEngine
        engine = LLMEngine.from_engine_args(EngineArgs(model={str(folder)!r}, dtype="float32", max_model_len=128))
        try:
            engine.add_request("r", "Hi", SamplingParams(max_tokens=2), trace_headers={{"traceparent": "x"}})
        except ValueError as e:
            assert str(e).startswith("trace_headers"), e
        else:
            raise SystemExit("trace_headers were accepted without tracing")
        engine.add_request("r", "Hi", SamplingParams(max_tokens=2))
        while engine.has_unfinished_requests():
            engine.step()
        loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
        assert not loaded, loaded
        import pagedllm.entrypoints.openai.api_server
        loaded = sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter")))
        assert not loaded, loaded
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
