"""The engine in a process of its own (as vLLM's ``EngineCoreProc``), behind an AsyncLLMEngine.

The server's process keeps HTTP parsing, JSON and SSE framing; the child builds the LLMEngine
from the parent's EngineConfig and runs it under an ``EngineLoop`` (scheduling, the model,
detokenization), so the two share no GIL. Transport: two one-way pipes of pickled dataclasses,
the commands and events of ``engine_loop.py``.

- Start-up: the child answers ``Ready``, or ``StartupFailed`` with the error's message and
  traceback, which the parent raises as ``EngineProcessError``.
- The child dies: the parent's reader sees the pipe close and reports ``LoopEnded`` with the exit
  code, which fails every request in flight and marks the engine dead (health turns 503).
- The parent dies: the child sees its command pipe close, aborts what is live and exits.
- Shutdown: a stop command, then terminate and kill if the child does not exit in time; the child
  is a daemon process, so an exiting parent never leaves it behind.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import pickle
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from pagedllm.config import EngineConfig
from pagedllm.engine.engine_loop import (
    Command,
    EngineLoop,
    Event,
    LoopEnded,
    Refused,
    StepFailed,
    StopCommand,
)

logger = logging.getLogger("pagedllm")

_LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


class EngineProcessError(RuntimeError):
    """The engine process could not start; the message is the child's error."""


@dataclass
class Ready:
    """The child built its engine and serves commands from now on."""


@dataclass
class StartupFailed:
    message: str
    traceback: str


class EngineProcess:
    """Parent side: starts the child, sends it commands, hands its events to ``on_event`` on a
    reader thread. Construction returns once the engine is ready (or raises its start-up error)."""

    def __init__(self, config: EngineConfig, on_event: Callable[[Event], None], idle_poll_s: float = 0.5,
                 num_processes: int = 1) -> None:
        """``num_processes``: engine processes sharing this host's CPUs (data-parallel replicas);
        the child takes its share of the CPU threads."""
        ctx = multiprocessing.get_context("spawn")
        child_commands, self._commands = ctx.Pipe(duplex=False)
        self._events, child_events = ctx.Pipe(duplex=False)
        log_level = logging.getLogger("pagedllm").getEffectiveLevel()
        self._process = ctx.Process(target=run_engine_process, name="pagedllm-engine", daemon=True,
                                    args=(config, child_commands, child_events, idle_poll_s, log_level,
                                          num_processes))
        self._process.start()
        # Only the child holds its ends now: when it dies, the event pipe closes for good.
        child_commands.close()
        child_events.close()
        self._send_lock = threading.Lock()
        self._on_event = on_event
        try:
            self._wait_ready()
        except BaseException:
            self._stop_process(timeout_s=5.0)
            raise
        self._reader = threading.Thread(target=self._read_events, name="pagedllm-engine-events", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> None:
        try:
            message = self._events.recv()
        except EOFError:
            self._process.join(5.0)
            raise EngineProcessError(
                f"the engine process exited during start-up (exit code {self._process.exitcode})") from None
        if isinstance(message, StartupFailed):
            raise EngineProcessError(f"the engine process failed to start: {message.message}\n{message.traceback}")

    def _read_events(self) -> None:
        try:
            while True:
                event = self._events.recv()
                self._on_event(event)
                if isinstance(event, LoopEnded):
                    return
        except (EOFError, OSError):
            self._process.join(1.0)
            error = f"the engine process died (exit code {self._process.exitcode})"
            logger.error("%s: failing every request in flight", error)
            self._on_event(LoopEnded(error))

    def send(self, command: Command) -> None:
        with self._send_lock:
            try:
                self._commands.send(command)
            except OSError:  # the child is gone: the reader reports it
                pass

    def is_alive(self) -> bool:
        return self._process.is_alive() and self._reader.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def shutdown(self, timeout_s: float) -> None:
        if self._process.is_alive():
            self.send(StopCommand())
        self._stop_process(timeout_s)
        self._reader.join(5.0)
        self._commands.close()

    def _stop_process(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the child to exit, then terminate it, then kill it."""
        self._process.join(timeout_s)
        if self._process.is_alive():
            logger.warning("the engine process did not stop in %.0f s: terminating it", timeout_s)
            self._process.terminate()
            self._process.join(5.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


# -- the child ------------------------------------------------------------------------------------
def run_engine_process(config: EngineConfig, commands: Connection, events: Connection, idle_poll_s: float,
                       log_level: int, num_processes: int = 1) -> None:
    """The child's main: build the engine, say Ready (or why not), serve commands until stopped."""
    # Ctrl-C reaches the whole process group; the parent decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=_LOG_FORMAT, datefmt="%H:%M:%S")
    from pagedllm.cpu_threads import configure_torch_threads
    from pagedllm.engine.llm_engine import LLMEngine

    try:
        # The parent's event loop keeps a CPU (cpu_threads.py); replicas split the rest.
        configure_torch_threads(for_server=True, num_processes=num_processes)
        engine = LLMEngine(config)
    except BaseException as e:
        events.send(StartupFailed(f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    events.send(Ready())
    channel = _ChildChannel(commands, events)
    EngineLoop(engine, channel.receive, channel.emit, idle_poll_s).run()


class _ChildChannel:
    """The child's ends of the pipes. A closed pipe means the parent is gone: the loop is told to stop."""

    def __init__(self, commands: Connection, events: Connection) -> None:
        self._commands = commands
        self._events = events
        self._parent_gone = False

    def receive(self, timeout: float | None) -> Command | None:
        if self._parent_gone:
            return StopCommand()
        try:
            if not self._commands.poll(timeout or 0.0):
                return None
            return self._commands.recv()
        except (EOFError, OSError):
            self._parent_gone = True
            return StopCommand()

    def emit(self, event: Event) -> None:
        if self._parent_gone:
            return
        try:
            self._events.send(_picklable(event))
        except OSError:
            self._parent_gone = True


def _picklable(event: Event) -> Event:
    """An event whose exception pickles: an error that does not becomes a RuntimeError with its text."""
    if isinstance(event, (Refused, StepFailed)):
        try:
            pickle.dumps(event.error)
        except Exception:
            error = RuntimeError(f"{type(event.error).__name__}: {event.error}")
            return dataclasses.replace(event, error=error)
    return event
