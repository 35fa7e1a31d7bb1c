"""EngineLoop: the loop that drives an LLMEngine for a front end, and the messages it speaks.

The front end (``AsyncLLMEngine``) sends commands (add, abort, stop); the loop applies them before
every step, steps while work remains, and reports what happened as events (accepted, refused, one
report per step, a failed step, the end of the loop). Commands and events are plain dataclasses
that pickle, so the same loop runs on a thread of the server's process (``EngineThread`` in
``async_engine.py``) or in a process of its own (``engine_proc.py``): only the transport differs.

Invariant: the loop is the only code that touches its LLMEngine, and it emits exactly one
``Accepted`` or ``Refused`` per ``AddCommand`` it receives, and one ``LoopEnded`` last.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.core.scheduler import SchedulerStats
from pagedllm.executor import WorkerFailedError
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # the front end reads it without importing the grammar machinery
    from pagedllm.structured_output.manager import StructuredOutputStats

logger = logging.getLogger("pagedllm")


# -- commands: front end -> loop ------------------------------------------------------------------
@dataclass
class AddCommand:
    """Add a request. ``add_id`` (unique per front end) names this add in the answer and in aborts."""

    add_id: int
    request_id: str
    prompt: Any
    params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    lora_request: Any = None
    tokenization_kwargs: dict[str, Any] | None = None
    trace_headers: dict[str, str] | None = None


@dataclass
class AbortCommand:
    """Abort requests; with ``add_id``, only the request that add created (never a later namesake)."""

    request_ids: list[str]
    add_id: int | None = None


@dataclass
class StopCommand:
    """Abort what is live, deliver the final outputs, end the loop."""


Command = AddCommand | AbortCommand | StopCommand


# -- events: loop -> front end --------------------------------------------------------------------
@dataclass
class Accepted:
    add_id: int


@dataclass
class Refused:
    """``add_request`` raised ``error`` (validation): the front end raises it to its caller as is."""

    add_id: int
    error: BaseException


@dataclass
class StepReport:
    """One step: its outputs, the scheduler's state after it, ``step_tokens`` ``{request id: (new
    tokens, prompt length)}`` of every request that generated tokens (whatever its output kind),
    and ``step_time``, the time stamp of those tokens (the one in their ``RequestMetrics``);
    ``structured_output_stats``: the grammar counters (None when the engine has no tokenizer)."""

    outputs: list[RequestOutput]
    scheduler_stats: SchedulerStats
    step_tokens: dict[str, tuple[int, int]] = field(default_factory=dict)
    step_time: float = 0.0
    structured_output_stats: StructuredOutputStats | None = None


@dataclass
class StepFailed:
    """A step raised ``error``: these requests were aborted and get the error; the loop goes on."""

    request_ids: list[str]
    error: BaseException


@dataclass
class LoopEnded:
    """The last event: ``error`` is None after a stop, else why the loop (or its process) died."""

    error: str | None = None


Event = Accepted | Refused | StepReport | StepFailed | LoopEnded


class EngineLoop:
    """Applies commands to an LLMEngine, steps it while it has work, and emits events.

    ``receive(timeout)`` returns the next command or None: it waits up to ``timeout`` seconds, or
    not at all when ``timeout`` is None. ``emit(event)`` hands an event to the front end. The loop
    blocks in ``receive`` only when the engine is idle, so commands take effect before the next step.
    Cost per step: the step itself plus its report (O(requests with new tokens)).
    """

    def __init__(self, engine: Any, receive: Callable[[float | None], Command | None],
                 emit: Callable[[Event], None], idle_poll_s: float = 0.5) -> None:
        self.engine = engine
        self._receive = receive
        self._emit = emit
        self._idle_poll_s = idle_poll_s
        self._live: dict[str, int] = {}  # request id -> the add_id that created it
        # The front end records and logs the stats of every step (``StepReport``): the engine
        # counts tokens per step for it and logs nothing itself.
        engine.report_steps()

    def run(self) -> None:
        """Serve commands until a StopCommand; always ends with a LoopEnded event."""
        error = None
        try:
            while self._apply_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step()
            self._abort_all_and_flush()
        except BaseException as e:  # the loop must never die silently: the front end fails its callers
            logger.exception("engine loop crashed")
            error = f"engine loop crashed: {e!r}"
        try:
            self.engine.shutdown()
        finally:
            self._emit(LoopEnded(error))

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command; False when asked to stop."""
        command = self._receive(self._idle_poll_s if block else None)
        while command is not None:
            if isinstance(command, StopCommand):
                return False
            if isinstance(command, AddCommand):
                self._add(command)
            else:
                self._abort(command)
            command = self._receive(None)
        return True

    def _add(self, cmd: AddCommand) -> None:
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time,
                                    lora_request=cmd.lora_request, tokenization_kwargs=cmd.tokenization_kwargs,
                                    trace_headers=cmd.trace_headers, priority=cmd.priority)
        except Exception as e:  # validation: surfaces from generate() as raised
            self._emit(Refused(cmd.add_id, e))
            return
        self._live[cmd.request_id] = cmd.add_id
        self._emit(Accepted(cmd.add_id))

    def _abort(self, cmd: AbortCommand) -> None:
        ids = cmd.request_ids
        if cmd.add_id is not None:  # a generator's own clean-up: never abort a newer namesake
            ids = [r for r in ids if self._live.get(r) == cmd.add_id]
        if ids:
            self.engine.abort_request(ids)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_live(e)
            if isinstance(e, WorkerFailedError):
                raise  # the workers are gone: end the loop, the engine is dead
            return
        for out in outputs:
            if out.finished:
                self._live.pop(out.request_id, None)
        self._emit(self.engine.step_report(outputs))

    def _fail_live(self, error: BaseException) -> None:
        """After a failed step: abort every live request and hand each caller the error."""
        ids = list(self._live)
        try:
            self.engine.abort_request(ids)
            self.engine.step()  # flushes the abort outputs, frees blocks
        except Exception:
            logger.exception("could not abort the failed requests cleanly")
        self._live.clear()
        self._emit(StepFailed(ids, error))

    def _abort_all_and_flush(self) -> None:
        """On stop: abort live requests so every caller gets a final "abort" output."""
        if not self._live:
            return
        self.engine.abort_request(list(self._live))
        deadline = time.monotonic() + 10.0
        while self.engine.has_unfinished_requests() and time.monotonic() < deadline:
            self._step()
