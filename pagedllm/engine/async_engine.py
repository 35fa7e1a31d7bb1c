"""AsyncLLMEngine: an asyncio front for LLMEngine, with the engine loop on a thread of its own.

    engine = AsyncLLMEngine.from_engine_args(EngineArgs())
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
        ...                                   # one RequestOutput per engine step (or fewer, merged)
    await engine.abort("req-1")

Threads: the LLMEngine is touched by the loop thread only. Event-loop code hands it work through a
thread-safe command queue (add / abort / stop); the loop thread drains that queue before every
step, so an abort takes effect before the next step runs. Each step's outputs go back to the event
loop(s) in one ``call_soon_threadsafe`` per loop and land in each request's ``RequestStream``.
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
from collections.abc import AsyncIterator, Iterable
from typing import Any

from pagedllm.config import EngineArgs, ModelConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.metrics import EngineMetrics
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagedllm")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down or crashed); no request can be served."""


class RequestStream:
    """The per-request mailbox on the event loop: at most one pending output (merged when DELTA)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, output_kind: RequestOutputKind) -> None:
        self.request_id = request_id
        self.loop = loop
        self.output_kind = output_kind
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
    if new.prompt_logprobs is not None:
        into.prompt_logprobs = new.prompt_logprobs


class AsyncLLMEngine:
    """asyncio front of an LLMEngine whose step loop runs on a background thread."""

    def __init__(self, engine: LLMEngine, log_stats: bool = True, log_interval_s: float = 10.0,
                 idle_poll_s: float = 0.5) -> None:
        self.engine = engine
        model_config = engine.get_model_config()
        self.metrics = EngineMetrics(model_config.served_model_name, log_interval_s if log_stats else None)
        # Token counts straight from each step (not from the RequestOutputs, which a non-streaming
        # FINAL_ONLY request gets only once, when it finishes).
        engine.output_processor.record_step_tokens()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        self._idle_poll_s = idle_poll_s
        self._pending_adds = 0  # adds handed over and not yet taken by the loop thread
        self._count_lock = threading.Lock()
        self._num_waiting = 0  # scheduler's waiting queue after the last step
        self._num_running = 0
        self._dead: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, usage_context: str = "ENGINE_CONTEXT", **kwargs: Any
    ) -> AsyncLLMEngine:
        return cls(LLMEngine.from_engine_args(engine_args, usage_context), **kwargs)

    # -- read-only views (safe from any thread) ----------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_model_config(self) -> ModelConfig:
        return self.engine.get_model_config()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None and not self._stopping

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def num_waiting_requests(self) -> int:
        """Requests not yet scheduled: the scheduler's waiting queue plus adds still in hand-over."""
        return self._num_waiting + self._pending_adds

    def num_running_requests(self) -> int:
        return self._num_running

    def num_live_requests(self) -> int:
        return len(self._streams) + self._pending_adds

    async def check_health(self) -> None:
        if not self.is_running:
            raise EngineDeadError(f"engine loop crashed: {self._dead!r}" if self._dead else "engine is shut down")

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
    ) -> AsyncIterator[RequestOutput]:
        """Yield this request's outputs as steps produce them; the last one has ``finished``.

        Raises add_request's ValueError/TypeError as is. Leaving the loop early (break,
        cancellation, client gone) aborts the request.
        """
        stream = await self.add_request(request_id, prompt, sampling_params, priority, arrival_time,
                                        lora_request, tokenization_kwargs)
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
    ) -> RequestStream:
        """Hand a request to the engine and wait until it is accepted (or raise its validation error).

        Iterate its outputs with ``stream_outputs``; the request is queued from now on.
        """
        await self.check_health()
        stream = self.submit(request_id, prompt, sampling_params, priority, arrival_time, lora_request,
                             tokenization_kwargs)
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
    ) -> RequestStream:
        """Queue a request without waiting (call from the event loop); then ``await wait_accepted``."""
        loop = asyncio.get_running_loop()
        kind = getattr(sampling_params, "output_kind", RequestOutputKind.CUMULATIVE)
        stream = RequestStream(request_id, loop, kind)
        if not self.is_running:
            stream.put_error(EngineDeadError("engine is shut down"))
            return stream
        arrival = time.time() if arrival_time is None else arrival_time
        with self._count_lock:
            self._pending_adds += 1
        self._commands.put(("add", stream, prompt, sampling_params, priority, arrival, lora_request,
                            tokenization_kwargs))
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
            self._commands.put(("abort", [stream.request_id], stream))

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their streams end with "abort"."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._commands.put(("abort", ids, None))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort whatever is live, stop the loop thread and wait for it (idempotent)."""
        if self._thread.is_alive():
            self._stopping = True
            self._commands.put(("stop",))
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._fail_all(EngineDeadError("engine is shut down"))  # adds that raced the stop
        self.engine.engine_core.shutdown()

    # -- the loop thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if not self._drain_commands(block=not busy):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                self.metrics.maybe_log()
            self._abort_all_and_flush()
        except BaseException as e:  # the loop must never die silently: fail every waiting caller
            logger.exception("engine loop crashed")
            self._dead = e
            self._fail_all(EngineDeadError(f"engine loop crashed: {e!r}"))

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued add/abort commands; False when asked to stop."""
        try:
            cmd = self._commands.get(timeout=self._idle_poll_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd[0] == "stop":
                return False
            if cmd[0] == "add":
                self._add(*cmd[1:])
            else:
                self._abort(cmd[1], cmd[2])
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, stream: RequestStream, prompt, params, priority, arrival, lora_request, tok_kwargs) -> None:
        rid = stream.request_id
        try:
            self.engine.add_request(rid, prompt, params, arrival_time=arrival, lora_request=lora_request,
                                    tokenization_kwargs=tok_kwargs, priority=priority)
        except Exception as e:  # validation: surfaces from generate() as raised
            stream.loop.call_soon_threadsafe(stream.put_error, e)
        else:
            self._streams[rid] = stream
            self._num_waiting += 1  # until the next step's stats say otherwise
            _call_soon(stream.loop, stream.accept)
            seq_ids = self.engine.output_processor.child_ids(rid) or [rid]
            self.metrics.on_request_added(rid, arrival, seq_ids)
        finally:
            with self._count_lock:
                self._pending_adds -= 1

    def _abort(self, ids: list[str], only_stream: RequestStream | None) -> None:
        if only_stream is not None:  # a generator's own clean-up: never abort a newer namesake
            ids = [r for r in ids if self._streams.get(r) is only_stream]
        if ids:
            self.engine.abort_request(ids)

    def _step(self) -> None:
        step_start = time.time()
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_live(e)
            return
        scheduler = getattr(self.engine.engine_core, "scheduler", None)
        stats = scheduler.stats() if scheduler is not None and hasattr(scheduler, "stats") else None
        if stats is not None:
            self._num_waiting, self._num_running = stats.num_waiting, stats.num_running
        # Recorded before delivery: a client that has its response finds it counted in /metrics.
        self.metrics.on_step(outputs, stats, scheduler, step_start, self.engine.output_processor.take_step_tokens())
        self._deliver(outputs)

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

    def _fail_live(self, error: BaseException) -> None:
        """After a failed step: abort every live request and hand each caller the error."""
        ids = list(self._streams)
        try:
            self.engine.abort_request(ids)
            self.engine.step()  # flushes the abort outputs, frees blocks
        except Exception:
            logger.exception("could not abort the failed requests cleanly")
        self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            self.metrics.forget(s.request_id)
            _call_soon(s.loop, s.put_error, error)
        # Adds still queued would wait forever: fail them too.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                with self._count_lock:
                    self._pending_adds -= 1
                _call_soon(cmd[1].loop, cmd[1].put_error, EngineDeadError("engine is shutting down"))

    def _abort_all_and_flush(self) -> None:
        """On stop: abort live requests so every caller gets a final "abort" output."""
        if self._streams:
            self.engine.abort_request(list(self._streams))
            deadline = time.monotonic() + 10.0
            while self.engine.has_unfinished_requests() and time.monotonic() < deadline:
                self._deliver(self.engine.step())
        self._fail_all(EngineDeadError("engine is shut down"))


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.put(out)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass
