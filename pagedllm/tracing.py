"""OpenTelemetry tracing of requests, as vLLM's: one ``llm_request`` span per finished request.

Enabled by ``otlp_traces_endpoint`` (``--otlp-traces-endpoint``): the engine then builds one
``RequestTracer``, which exports over OTLP/HTTP (``opentelemetry-exporter-otlp-proto-http``, the
``tracing`` extra) to that URL, e.g. ``http://localhost:4318/v1/traces``. Each span is parented on
the W3C ``traceparent`` / ``tracestate`` given in the request's ``trace_headers`` (the server
passes the HTTP request's), starts at the request's arrival and ends when it finished, and
carries vLLM's ``gen_ai.*`` attributes: token counts, sampling parameters, and the queue,
prefill, decode and end-to-end times from its ``RequestMetrics``.

Nothing of opentelemetry is imported unless an endpoint is set: this module imports it inside
``RequestTracer`` only. Without an endpoint the engine refuses ``trace_headers`` (ValueError
naming it) rather than accept and drop them; the server, as vLLM's, forwards the headers only when
tracing is on and otherwise logs one warning.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from typing import Any

from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")

# The W3C trace-context headers (lower case, as HTTP frameworks hand them over).
TRACE_HEADERS = ("traceparent", "tracestate")


class SpanAttributes:
    """vLLM's span attribute names (the OpenTelemetry gen-ai conventions plus vLLM's latency ones)."""

    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


SPAN_NAME = "llm_request"


def check_tracing_available() -> None:
    """Raise ValueError naming ``otlp_traces_endpoint`` when the OpenTelemetry packages are missing."""
    needed = ("opentelemetry", "opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
    try:
        missing = [name for name in needed if importlib.util.find_spec(name) is None]
    except ModuleNotFoundError:  # a parent package is missing
        missing = list(needed)
    if missing:
        raise ValueError("otlp_traces_endpoint needs the OpenTelemetry packages (missing: "
                         f"{', '.join(missing)}): pip install 'pagedllm[tracing]'")


def extract_trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace-context headers among ``headers`` (any case), with lower-case names."""
    return {k.lower(): v for k, v in headers.items() if k.lower() in TRACE_HEADERS}


_warned_disabled = False


def log_tracing_disabled_warning() -> None:
    """Warn, once per process, that a request carried trace context while tracing is off (vLLM's)."""
    global _warned_disabled
    if not _warned_disabled:
        _warned_disabled = True
        logger.warning("a request carried trace context (traceparent) but tracing is off: "
                       "start the server with --otlp-traces-endpoint to export spans")


def otlp_span_exporter(endpoint: str) -> Any:
    """The OTLP/HTTP span exporter to ``endpoint`` (tests replace this with an in-memory one)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)


class RequestTracer:
    """Turns finished requests into spans and exports them in batches from a background thread.

    Owns its own ``TracerProvider`` (the global one is left alone, so several engines in one
    process each export where they were told). Cost per finished request: one span built and
    queued; the export happens off the engine's thread.
    """

    def __init__(self, endpoint: str, model_name: str = "") -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(resource=Resource.create({"service.name": "pagedllm"}))
        self._provider.add_span_processor(BatchSpanProcessor(otlp_span_exporter(endpoint)))
        self._tracer = self._provider.get_tracer("pagedllm.engine")
        self._propagator = TraceContextTextMapPropagator()
        self._server_kind = SpanKind.SERVER
        self.model_name = model_name

    def trace_request(self, output: RequestOutput, params: SamplingParams,
                      trace_headers: Mapping[str, str] | None) -> None:
        """Export the span of a finished request (its ``metrics`` filled by the engine)."""
        m = output.metrics
        if m is None or m.finished_time is None:
            return
        context = self._propagator.extract(carrier=dict(trace_headers)) if trace_headers else None
        span = self._tracer.start_span(SPAN_NAME, context=context, kind=self._server_kind,
                                       start_time=int(m.arrival_time * 1e9))
        span.set_attributes(_span_attributes(output, params, self.model_name))
        span.end(end_time=int(m.finished_time * 1e9))

    def force_flush(self, timeout_ms: int = 5000) -> bool:
        return self._provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """Export what is queued and stop the export thread."""
        self._provider.shutdown()


def _span_attributes(output: RequestOutput, params: SamplingParams, model_name: str) -> dict[str, Any]:
    m = output.metrics
    attrs: dict[str, Any] = {
        SpanAttributes.GEN_AI_REQUEST_ID: output.request_id,
        SpanAttributes.GEN_AI_RESPONSE_MODEL: model_name,
        SpanAttributes.GEN_AI_RESPONSE_FINISH_REASONS: [c.finish_reason or "abort" for c in output.outputs],
        SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: len(output.prompt_token_ids),
        SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: sum(len(c.token_ids) for c in output.outputs),
        SpanAttributes.GEN_AI_USAGE_NUM_SEQUENCES: len(output.outputs),
        SpanAttributes.GEN_AI_REQUEST_N: params.n,
        SpanAttributes.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
        SpanAttributes.GEN_AI_REQUEST_TOP_P: params.top_p,
        SpanAttributes.GEN_AI_LATENCY_E2E: m.finished_time - m.arrival_time,
    }
    if params.max_tokens is not None:
        attrs[SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS] = params.max_tokens
    if m.time_in_queue is not None:
        attrs[SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE] = m.time_in_queue
    if m.first_token_time is not None:
        attrs[SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = m.first_token_time - m.arrival_time
        attrs[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = m.last_token_time - m.first_token_time
        if m.first_scheduled_time is not None:
            attrs[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = m.first_token_time - m.first_scheduled_time
            attrs[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = m.last_token_time - m.first_scheduled_time
    return attrs
