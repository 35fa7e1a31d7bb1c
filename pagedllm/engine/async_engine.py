"""AsyncLLMEngine: an asyncio front for an LLMEngine that runs on a thread or in a process of its own.

    engine = AsyncLLMEngine.from_engine_args(EngineArgs())                       # engine on a thread
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(), engine_process=True)  # in a child process
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
        ...                                   # one RequestOutput per engine step (or fewer, merged)
    await engine.abort("req-1")

The LLMEngine is driven by an ``EngineLoop`` (engine_loop.py), the only code that touches it.
Event-loop code hands it commands (add / abort / stop); the loop applies them before every step,
so an abort takes effect before the next step runs. The loop's events come back on one thread of
this process (the loop thread itself, or the thread reading the child process's pipe) and land in
each request's ``RequestStream`` through one ``call_soon_threadsafe`` per event loop. In a child
process (``engine_proc.py``), scheduling, the model and detokenization share no GIL with the
server's HTTP parsing, JSON and SSE framing.
A stream holds at most one undelivered output: with ``RequestOutputKind.DELTA`` a new output is
merged into it, otherwise it replaces it; a slow consumer never makes a queue grow.
Validation errors of ``add_request`` are raised by ``generate()`` itself, unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

from pagedllm.config import EngineArgs, EngineConfig, ModelConfig
from pagedllm.engine.config_builder import create_engine_config
from pagedllm.engine.data_parallel import DataParallelEngines
from pagedllm.engine.engine_loop import (
    AbortCommand,
    Accepted,
    AddCommand,
    Command,
    EngineLoop,
    Event,
    LoopEnded,
    Refused,
    StepFailed,
    StepReport,
    StopCommand,
)
from pagedllm.engine.engine_proc import EngineProcess
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.metrics import EngineMetrics
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagedllm")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down or crashed); no request can be served."""


class RequestStream:
    """The per-request mailbox on the event loop: at most one pending output (merged when DELTA)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, output_kind: RequestOutputKind,
                 arrival_time: float) -> None:
        self.request_id = request_id
        self.loop = loop
        self.output_kind = output_kind
        self.arrival_time = arrival_time
        self.add_id = -1  # set when the add is sent: names this request (not a namesake) in aborts
        self.num_seqs = 1  # sequences the scheduler will hold for it (SamplingParams.n)
        self.pending: RequestOutput | None = None
        self.error: BaseException | None = None
        self.event = asyncio.Event()
        self.accepted = asyncio.Event()  # set when the engine took the request, or refused it
        self.finished = False  # its final output has arrived

    def accept(self) -> None:
        self.accepted.set()

    # Called on the event loop only.
    def put(self, out: RequestOutput) -> None:
        self.finished = out.finished
        if self.pending is None or self.output_kind != RequestOutputKind.DELTA:
            self.pending = out
        else:
            _merge_delta(self.pending, out)
        self.event.set()

    def put_error(self, error: BaseException) -> None:
        self.error = error
        self.accepted.set()
        self.event.set()

    async def get(self) -> RequestOutput:
        while self.pending is None:
            if self.error is not None:
                raise self.error
            await self.event.wait()
            self.event.clear()
        out, self.pending = self.pending, None
        return out


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Fold a DELTA output into an undelivered one of the same request."""
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            continue
        old.text += c.text
        old.token_ids = list(old.token_ids) + list(c.token_ids)
        if c.logprobs is not None:
            old.logprobs = list(old.logprobs or []) + list(c.logprobs)
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens
    into.metrics = new.metrics
    if new.prompt_logprobs is not None:
        into.prompt_logprobs = new.prompt_logprobs


class EngineThread:
    """Runs an EngineLoop on a daemon thread of this process; commands go through a queue and
    events are handed to ``on_event`` on that thread."""

    def __init__(self, engine: LLMEngine, on_event: Callable[[Event], None], idle_poll_s: float) -> None:
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        loop = EngineLoop(engine, self._receive, on_event, idle_poll_s)
        self._thread = threading.Thread(target=loop.run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    def _receive(self, timeout: float | None) -> Command | None:
        try:
            return self._commands.get_nowait() if timeout is None else self._commands.get(timeout=timeout)
        except queue.Empty:
            return None

    def send(self, command: Command) -> None:
        self._commands.put(command)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout_s: float) -> None:
        if self._thread.is_alive():
            self.send(StopCommand())
            self._thread.join(timeout_s)


class AsyncLLMEngine:
    """asyncio front of an LLMEngine driven by an EngineLoop on a thread or in a child process.

    Invariant: every request handed over ends with its final output or an error, never silence:
    an add is answered (accepted / refused), and when the loop ends every stream and unanswered
    add is failed. ``_streams`` and the metrics are touched by the event thread only; ``_adding``
    (adds sent and not yet answered) is shared with the event loop(s) under ``_lock``.
    """

    def __init__(self, engine: LLMEngine | EngineConfig, log_stats: bool | None = None, log_interval_s: float = 10.0,
                 idle_poll_s: float = 0.5) -> None:
        """``engine``: an LLMEngine, run on a thread of this process; or an EngineConfig, from which
        a child process builds its LLMEngine (raises ``EngineProcessError`` if it cannot start), one
        child per replica above one ``data_parallel_size`` (``data_parallel.py``).
        ``log_stats``: log the periodic stats line (None: unless the config's ``disable_log_stats``);
        the Prometheus metrics are recorded either way."""
        if isinstance(engine, EngineConfig):
            from pagedllm.loader import load_tokenizer

            self._config = engine
            mc = engine.model_config
            self.tokenizer = None if mc.skip_tokenizer_init else load_tokenizer(mc.source, mc.tokenizer)
        else:
            self._config = engine.get_engine_config()
            self.tokenizer = engine.get_tokenizer()
        if log_stats is None:
            log_stats = self._config.log_stats
        self.metrics = EngineMetrics(self._config.model_config.served_model_name,
                                     log_interval_s if log_stats else None)
        self._lock = threading.Lock()
        self._adding: dict[int, RequestStream] = {}
        self._next_add_id = 0
        self._closed = False  # the loop has ended: no add can be answered any more
        self._streams: dict[str, RequestStream] = {}  # event thread only
        self._num_waiting = 0  # scheduler's waiting queue after the last step
        self._num_running = 0
        self._dead: str | None = None  # why the loop died
        self._stopping = False
        if isinstance(engine, EngineConfig) and engine.parallel_config.data_parallel_size > 1:
            self._backend: EngineThread | EngineProcess | DataParallelEngines = DataParallelEngines(
                engine, self._on_event, idle_poll_s)
        elif isinstance(engine, EngineConfig):
            self._backend = EngineProcess(engine, self._on_event, idle_poll_s)
        else:
            self._backend = EngineThread(engine, self._on_event, idle_poll_s)

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, usage_context: str = "ENGINE_CONTEXT", engine_process: bool = False,
        **kwargs: Any,
    ) -> AsyncLLMEngine:
        """``engine_process``: run the engine in a child process instead of a thread of this one
        (always so above one ``data_parallel_size`` replica: one process per engine core)."""
        if engine_process or engine_args.data_parallel_size > 1:
            return cls(create_engine_config(engine_args, usage_context), **kwargs)
        return cls(LLMEngine.from_engine_args(engine_args, usage_context), **kwargs)

    # -- read-only views (safe from any thread) ----------------------------------------------------
    def get_tokenizer(self):
        return self.tokenizer

    def get_model_config(self) -> ModelConfig:
        return self._config.model_config

    def get_engine_config(self) -> EngineConfig:
        return self._config

    @property
    def is_running(self) -> bool:
        return self._backend.is_alive() and self._dead is None and not self._stopping

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def is_tracing_enabled(self) -> bool:
        """Whether requests become OpenTelemetry spans (``otlp_traces_endpoint``): only then may
        ``trace_headers`` be given (the server forwards the HTTP trace headers only then)."""
        return self._config.observability_config.otlp_traces_endpoint is not None

    def num_waiting_requests(self) -> int:
        """Sequences not yet scheduled: the scheduler's waiting queue (as of the last step, plus
        those accepted since) and those of adds not yet answered. A request with ``n`` choices
        counts ``n``, as the scheduler holds one sequence per choice."""
        with self._lock:
            adding = sum(s.num_seqs for s in self._adding.values())
        return self._num_waiting + adding

    def num_running_requests(self) -> int:
        """Sequences the scheduler ran at its last step (at most ``max_num_seqs``)."""
        return self._num_running

    def num_live_requests(self) -> int:
        return len(self._streams) + len(self._adding)

    async def check_health(self) -> None:
        if not self.is_running:
            raise EngineDeadError(self._dead or "engine is shut down")

    # -- requests ---------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield this request's outputs as steps produce them; the last one has ``finished``.

        Raises add_request's ValueError/TypeError as is. Leaving the loop early (break,
        cancellation, client gone) aborts the request.
        """
        stream = await self.add_request(request_id, prompt, sampling_params, priority, arrival_time,
                                        lora_request, tokenization_kwargs, trace_headers)
        outputs = self.stream_outputs(stream)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()

    async def add_request(
        self,
        request_id: str,
        prompt: Any,
        sampling_params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> RequestStream:
        """Hand a request to the engine and wait until it is accepted (or raise its validation error).

        Iterate its outputs with ``stream_outputs``; the request is queued from now on.
        """
        await self.check_health()
        stream = self.submit(request_id, prompt, sampling_params, priority, arrival_time, lora_request,
                             tokenization_kwargs, trace_headers)
        await self.wait_accepted(stream)
        return stream

    def submit(
        self,
        request_id: str,
        prompt: Any,
        sampling_params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> RequestStream:
        """Queue a request without waiting (call from the event loop); then ``await wait_accepted``."""
        kind = getattr(sampling_params, "output_kind", RequestOutputKind.CUMULATIVE)
        arrival = time.time() if arrival_time is None else arrival_time
        stream = RequestStream(request_id, asyncio.get_running_loop(), kind, arrival)
        stream.num_seqs = max(1, int(getattr(sampling_params, "n", 1) or 1))
        with self._lock:
            if self._closed or not self.is_running:
                stream.put_error(EngineDeadError(self._dead or "engine is shut down"))
                return stream
            stream.add_id, self._next_add_id = self._next_add_id, self._next_add_id + 1
            self._adding[stream.add_id] = stream
        try:
            self._backend.send(AddCommand(stream.add_id, request_id, prompt, sampling_params, priority, arrival,
                                          lora_request, tokenization_kwargs,
                                          dict(trace_headers) if isinstance(trace_headers, Mapping) else trace_headers))
        except Exception:  # e.g. a prompt that cannot be pickled for the engine process
            with self._lock:
                self._adding.pop(stream.add_id, None)
            raise
        return stream

    async def wait_accepted(self, stream: RequestStream) -> None:
        """Wait until the engine took the request; raise its validation error if it refused it."""
        try:
            await stream.accepted.wait()
        except asyncio.CancelledError:
            self.abort_stream(stream)
            raise
        if stream.error is not None:
            raise stream.error

    async def wait_all_accepted(self, streams: list[RequestStream]) -> None:
        """``wait_accepted`` for each of a request's prompts; if any is refused (or the wait is
        cancelled) every one of them is aborted before the error is raised."""
        try:
            for stream in streams:
                await self.wait_accepted(stream)
        except BaseException:
            for stream in streams:
                self.abort_stream(stream)
            raise

    async def stream_outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """The outputs of an accepted request; leaving early aborts it."""
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort_stream(stream)

    def abort_stream(self, stream: RequestStream) -> None:
        """Abort the request behind this stream (and never a later request with the same id)."""
        if stream.error is None and not stream.finished:
            self._backend.send(AbortCommand([stream.request_id], stream.add_id))

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their streams end with "abort"."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._backend.send(AbortCommand(ids))

    async def __aenter__(self) -> AsyncLLMEngine:
        """``async with AsyncLLMEngine.from_engine_args(...) as engine:`` (the seed's form); the
        engine is shut down when the block exits, normally or by an exception."""
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.shutdown()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort whatever is live, stop the engine loop (and its process) and wait for it (idempotent)."""
        self._stopping = True
        self._backend.shutdown(timeout_s)
        if not self._backend.is_alive():
            self._fail_all(EngineDeadError("engine is shut down"))  # adds that raced the stop

    # -- the loop's events (on the event thread) --------------------------------------------------
    def _on_event(self, event: Event) -> None:
        if isinstance(event, StepReport):
            self._on_step(event)
        elif isinstance(event, Accepted):
            stream = self._take_adding(event.add_id)
            if stream is not None:
                self._streams[stream.request_id] = stream
                self._num_waiting += stream.num_seqs  # until the next step's stats say otherwise
                self.metrics.on_request_added(stream.request_id, stream.arrival_time)
                _call_soon(stream.loop, stream.accept)
        elif isinstance(event, Refused):
            stream = self._take_adding(event.add_id)
            if stream is not None:
                _call_soon(stream.loop, stream.put_error, event.error)
        elif isinstance(event, StepFailed):
            for rid in event.request_ids:
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    self.metrics.forget(rid)
                    _call_soon(stream.loop, stream.put_error, event.error)
        elif isinstance(event, LoopEnded):
            self._dead = event.error
            self._fail_all(EngineDeadError(event.error or "engine is shut down"))

    def _take_adding(self, add_id: int) -> RequestStream | None:
        """The stream of an answered add; None if it was failed meanwhile (a shutdown that timed out)."""
        with self._lock:
            return self._adding.pop(add_id, None)

    def _on_step(self, report: StepReport) -> None:
        stats = report.scheduler_stats
        self._num_waiting, self._num_running = stats.num_waiting, stats.num_running
        # Recorded before delivery: a client that has its response finds it counted in /metrics.
        self.metrics.on_step(report)
        self._deliver(report.outputs)
        self.metrics.maybe_log()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _fail_all(self, error: BaseException) -> None:
        """The loop has ended: fail every live stream and every add it will never answer."""
        with self._lock:
            self._closed = True
            unanswered, self._adding = list(self._adding.values()), {}
        streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            self.metrics.forget(s.request_id)
            _call_soon(s.loop, s.put_error, error)
        for s in unanswered:
            _call_soon(s.loop, s.put_error, error)


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.put(out)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass
