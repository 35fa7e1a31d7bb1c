"""Engine metrics: Prometheus collectors named as vLLM's (prefix ``pagedllm:``) and a periodic log line.

``EngineMetrics`` is fed by one writer: the server front end's event thread, or an ``LLMEngine``
started with stats on (``disable_log_stats=False``). ``on_request_added`` when the engine accepted
a request, ``on_step`` with every step's ``StepReport`` (its outputs, token counts, the time stamp
of its tokens and the scheduler's stats). Every latency comes from the engine's own time stamps,
the ones in ``RequestOutput.metrics`` (``RequestMetrics``): token times are the step's stamp,
queue, prefill, decode and end-to-end times are read from the finished output. The collectors
live in a registry of their own (several engines in one process, as in tests, do not collide);
``render()`` gives the text exposition for ``/metrics``, ``snapshot()`` the same as objects.
Cost: O(outputs + requests with new tokens) per step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

try:  # no "<name>_created" series beside every counter and histogram (as vLLM's exposition)
    from prometheus_client import disable_created_metrics

    disable_created_metrics()
except ImportError:  # pragma: no cover - older prometheus_client
    pass

from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine.engine_loop import StepReport
from pagedllm.engine.metrics_reader import Metric, get_metrics_snapshot
from pagedllm.outputs import RequestOutput

if TYPE_CHECKING:
    from pagedllm.structured_output.manager import StructuredOutputStats

logger = logging.getLogger("pagedllm")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BITMASK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


@dataclass
class _RequestTimes:
    arrival_time: float
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class _Interval:
    """Counts since the last log line."""

    start: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_drafts: int = 0  # speculative decoding: verified drafts and their accepted tokens
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class EngineMetrics:
    """Prometheus collectors + per-request timing. Invariant: one writer (the front end's event thread)."""

    def __init__(self, model_name: str, log_interval_s: float | None = 10.0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.log_interval_s = log_interval_s
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.num_running = gauge("pagedllm:num_requests_running", "Number of requests in the running batch.")
        self.num_waiting = gauge("pagedllm:num_requests_waiting", "Number of requests waiting to be scheduled.")
        self.kv_usage = gauge("pagedllm:kv_cache_usage_perc",
                              "KV-cache usage: fraction of blocks held by live requests (1 = full).")
        self.prefix_queries = counter("pagedllm:prefix_cache_queries",
                                      "Prefix-cache queries, in tokens (prompt tokens looked up).")
        self.prefix_hits = counter("pagedllm:prefix_cache_hits", "Prefix-cache hits, in tokens.")
        self.preemptions = counter("pagedllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("pagedllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("pagedllm:generation_tokens", "Number of generation tokens processed.")
        self._success = Counter("pagedllm:request_success", "Count of finished requests by finish reason.",
                                labels + ["finished_reason"], registry=self.registry)
        self.ttft = histogram("pagedllm:time_to_first_token_seconds", "Time to first token in seconds.",
                              _TTFT_BUCKETS)
        self.itl = histogram("pagedllm:inter_token_latency_seconds", "Time between output tokens in seconds.",
                             _ITL_BUCKETS)
        self.e2e = histogram("pagedllm:e2e_request_latency_seconds",
                             "End-to-end request latency (arrival to finish) in seconds.", _LATENCY_BUCKETS)
        self.queue_time = histogram("pagedllm:request_queue_time_seconds",
                                    "Time a request spent waiting before it was first scheduled.",
                                    _LATENCY_BUCKETS)
        self.prefill_time = histogram("pagedllm:request_prefill_time_seconds",
                                      "Time from a request's first schedule to its first token.", _LATENCY_BUCKETS)
        self.decode_time = histogram("pagedllm:request_decode_time_seconds",
                                     "Time from a request's first token to its last token.", _LATENCY_BUCKETS)
        self.inference_time = histogram("pagedllm:request_inference_time_seconds",
                                        "Time from a request's first schedule to its last token.", _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("pagedllm:request_prompt_tokens",
                                               "Number of prompt tokens per finished request.", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("pagedllm:request_generation_tokens",
                                                   "Number of generated tokens per finished request.",
                                                   _TOKEN_BUCKETS)
        self._add_structured_output_collectors(counter, histogram)
        self._requests: dict[str, _RequestTimes] = {}
        self._last_prefix = (0, 0)
        self._last_preemptions = 0
        self._spec: _SpecDecodeCounters | None = None  # registered once the engine has drafted
        self._interval = _Interval()
        self._last_stats: SchedulerStats | None = None

    def _add_structured_output_collectors(self, counter, histogram) -> None:
        """Grammar compiles, cache hits, bitmask CPU time and jump-forward tokens (structured output)."""
        self.grammar_compile_time = histogram(
            "pagedllm:structured_output_compile_time_seconds",
            "Time to compile one grammar (JSON schema, regex, choice, EBNF), on the compile threads.",
            _COMPILE_BUCKETS)
        self.grammars_compiled = counter("pagedllm:structured_output_compiled",
                                         "Grammars compiled (constraints not found in the grammar cache).")
        self.grammar_cache_hits = counter("pagedllm:structured_output_cache_hits",
                                          "Constrained requests whose grammar was already compiled or compiling.")
        self.bitmask_time = histogram("pagedllm:structured_output_bitmask_time_seconds",
                                      "CPU time filling the token bitmask, per step with constrained requests.",
                                      _BITMASK_BUCKETS)
        self.jumped_tokens = counter("pagedllm:structured_output_jump_forward_tokens",
                                     "Output tokens appended by jump-forward decoding (forced by the grammar, "
                                     "not sampled).")
        self._last_structured = (0, 0, 0.0, 0, 0)  # compiled, hits, bitmask s, bitmask steps, jumped

    # -- fed by the engine loop's events ------------------------------------------------------
    def on_request_added(self, request_id: str, arrival_time: float) -> None:
        self._requests[request_id] = _RequestTimes(arrival_time)

    def on_step(self, report: StepReport) -> None:
        """Record one step: the tokens each request generated in it (whatever its output kind), at
        the step's time stamp; its finished requests; and the scheduler's state."""
        if report.step_tokens:
            self._record_tokens(report.step_tokens, report.step_time)
        for out in report.outputs:
            if out.finished:
                self._record_finish(out)
        self._record_scheduler(report.scheduler_stats)
        if report.structured_output_stats is not None:
            self._record_structured_output(report.structured_output_stats)

    def forget(self, request_id: str) -> None:
        """Drop a request that ended without a final output (engine failure)."""
        self._requests.pop(request_id, None)

    def _record_finish(self, out: RequestOutput) -> None:
        """A finished request: its finish reason, token counts and its ``RequestMetrics`` latencies."""
        times = self._requests.pop(out.request_id, None)
        if times is None:
            return
        if not isinstance(out, RequestOutput):  # a pooling request: "stop", or aborted (no vector)
            reason = "stop" if out.outputs is not None else "abort"
        else:
            reason = out.outputs[0].finish_reason if out.outputs else "abort"
        self._success.labels(self.model_name, reason or "abort").inc()
        if times.first_token_time is not None:
            self.request_prompt_tokens.observe(times.num_prompt_tokens)
            self.request_generation_tokens.observe(times.num_generation_tokens)
        m = getattr(out, "metrics", None)
        if m is None:
            return
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m.time_in_queue is not None:
            self.queue_time.observe(m.time_in_queue)
        if m.first_scheduled_time is not None and m.first_token_time is not None:
            self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
            self.decode_time.observe(m.last_token_time - m.first_token_time)
            self.inference_time.observe(m.last_token_time - m.first_scheduled_time)

    def _record_tokens(self, step_tokens: dict[str, tuple[int, int]], now: float) -> None:
        """Each request's new tokens arrived at ``now``: TTFT (and its prompt tokens) on its first,
        else an inter-token latency sample. The counters get one increment per step (a lock each)."""
        prompt = generated = 0
        for rid, (new, prompt_len) in step_tokens.items():
            times = self._requests.get(rid)
            if times is None or not new:
                continue
            if times.first_token_time is None:
                times.first_token_time = now
                times.num_prompt_tokens = prompt_len
                self.ttft.observe(now - times.arrival_time)
                prompt += prompt_len
            elif times.last_token_time is not None:
                self.itl.observe(now - times.last_token_time)
            times.last_token_time = now
            times.num_generation_tokens += new
            generated += new
        if prompt:
            self.prompt_tokens.inc(prompt)
            self._interval.prompt_tokens += prompt
        if generated:
            self.generation_tokens.inc(generated)
            self._interval.generation_tokens += generated

    def _record_scheduler(self, stats: SchedulerStats) -> None:
        self._last_stats = stats
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        q, h = stats.prefix_cache_queries, stats.prefix_cache_hits
        dq, dh = max(0, q - self._last_prefix[0]), max(0, h - self._last_prefix[1])
        self._last_prefix = (q, h)
        if dq:
            self.prefix_queries.inc(dq)
            self._interval.prefix_queries += dq
        if dh:
            self.prefix_hits.inc(dh)
            self._interval.prefix_hits += dh
        dp = max(0, stats.num_preemptions_total - self._last_preemptions)
        self._last_preemptions = stats.num_preemptions_total
        if dp:
            self.preemptions.inc(dp)
        if stats.spec_decoding is not None:
            if self._spec is None:
                self._spec = _SpecDecodeCounters(self.registry, self.model_name)
            self._spec.record(stats.spec_decoding, self._interval)

    def _record_structured_output(self, stats: StructuredOutputStats) -> None:
        """A histogram sample per new compile and per step that filled bitmasks (the step's CPU time);
        the counters grow by the change of the manager's cumulative ones."""
        for seconds in stats.new_compile_times_s:
            self.grammar_compile_time.observe(seconds)
        compiled, hits, bitmask_s, bitmask_steps, jumped = self._last_structured
        if stats.num_compiled > compiled:
            self.grammars_compiled.inc(stats.num_compiled - compiled)
        if stats.num_cache_hits > hits:
            self.grammar_cache_hits.inc(stats.num_cache_hits - hits)
        if stats.num_jumped_tokens > jumped:
            self.jumped_tokens.inc(stats.num_jumped_tokens - jumped)
        new_steps = stats.num_bitmask_steps - bitmask_steps
        for _ in range(new_steps):  # one per step in practice (a report per step)
            self.bitmask_time.observe((stats.bitmask_time_s - bitmask_s) / new_steps)
        self._last_structured = (stats.num_compiled, stats.num_cache_hits, stats.bitmask_time_s,
                                 stats.num_bitmask_steps, stats.num_jumped_tokens)

    # -- periodic log line ---------------------------------------------------------------------
    def maybe_log(self) -> str | None:
        """Log the throughput line when the interval has passed and something happened in it."""
        if self.log_interval_s is None:
            return None
        iv = self._interval
        elapsed = time.monotonic() - iv.start
        if elapsed < self.log_interval_s:
            return None
        stats = self._last_stats
        busy = stats is not None and (stats.num_running or stats.num_waiting)
        self._interval = _Interval()
        if not (iv.prompt_tokens or iv.generation_tokens or busy):
            return None
        hit_rate = 100.0 * iv.prefix_hits / iv.prefix_queries if iv.prefix_queries else 0.0
        line = (
            f"Avg prompt throughput: {iv.prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {iv.generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {stats.num_running if stats else 0} reqs, Waiting: {stats.num_waiting if stats else 0} reqs, "
            f"KV cache usage: {100.0 * (stats.kv_cache_usage if stats else 0.0):.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%"
        )
        if iv.num_drafts:
            line += (f", Spec decode mean acceptance length: {1 + iv.num_accepted_tokens / iv.num_drafts:.2f}, "
                     f"draft acceptance rate: {100.0 * iv.num_accepted_tokens / iv.num_draft_tokens:.1f}%")
        logger.info(line)
        return line

    def snapshot(self) -> list[Metric]:
        """Every metric as an object (``LLM.get_metrics()``, vLLM's reader types)."""
        return get_metrics_snapshot(self.registry)

    def render(self) -> bytes:
        """The Prometheus text exposition of every collector."""
        return generate_latest(self.registry)


class _SpecDecodeCounters:
    """Speculative decoding's counters (vLLM's ``spec_decode_*``), fed the scheduler's running
    totals (``SpecDecodingStats``): each is advanced by what the totals grew since the last step.
    ``num_accepted_tokens_per_pos`` has one series per draft position (label ``position``)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self.model_name = model_name
        self.num_drafts = Counter("pagedllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels,
                                  registry=registry).labels(model_name)
        self.num_draft_tokens = Counter("pagedllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels,
                                        registry=registry).labels(model_name)
        self.num_accepted_tokens = Counter("pagedllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                           labels, registry=registry).labels(model_name)
        self.per_pos = Counter("pagedllm:spec_decode_num_accepted_tokens_per_pos",
                               "Accepted tokens per draft position.", labels + ["position"], registry=registry)
        self._last = (0, 0, 0)
        self._last_per_pos: list[int] = []

    def record(self, totals: Any, interval: _Interval) -> None:
        now = (totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens)
        drafts, draft_tokens, accepted = (a - b for a, b in zip(now, self._last))
        self._last = now
        if not drafts:
            return
        self.num_drafts.inc(drafts)
        self.num_draft_tokens.inc(draft_tokens)
        self.num_accepted_tokens.inc(accepted)
        interval.num_drafts += drafts
        interval.num_draft_tokens += draft_tokens
        interval.num_accepted_tokens += accepted
        per_pos = totals.num_accepted_tokens_per_pos
        last = self._last_per_pos + [0] * (len(per_pos) - len(self._last_per_pos))
        for pos, (n, before) in enumerate(zip(per_pos, last)):
            series = self.per_pos.labels(self.model_name, str(pos))
            if n > before:
                series.inc(n - before)
        self._last_per_pos = list(per_pos)
