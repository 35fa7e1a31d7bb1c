"""ConnectionExecutor: the driver side shared by the executors that reach one worker per rank over a
``multiprocessing.connection.Connection`` (a pipe to a spawned process, or a TCP connection to a Ray
actor).

Each call is pickled once and written to every worker's connection (the broadcast of the step's
``SchedulerOutput``, in the compact wire form of ``step_codec.py``); only the output rank
(``ParallelConfig.output_rank``) sends a step's ``ModelRunnerOutput`` back (``mp_worker.py`` says
which calls reply). With async scheduling a rank holds a sampled step's reply until the next
step's forward is launched; the driver that waits for the last step it sampled (pipeline parallel:
nothing more to launch while micro-batches are in flight) first sends ``flush``. While it waits
for a reply the driver watches every connection (and, where it has them, the workers' process
sentinels): a worker that reports an exception, closes its connection or exits makes the call
raise ``WorkerFailedError`` naming the rank and the cause, and every later call raises the same
error, so the engine fails loudly rather than hang.
"""

from __future__ import annotations

import itertools
import pickle
from abc import abstractmethod
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor
from pagedllm.executor.step_codec import encode_scheduler_output
from pagedllm.sample.bitmask import GrammarOutput


class WorkerFailedError(RuntimeError):
    """A worker raised, exited or lost its connection; the message names its rank and the cause."""


class _ConnectionStepFuture:
    """The output of the ``seq``-th sampled step; ``result()`` reads the output rank's replies in
    order until its own has arrived (steps are launched and their results read in the same order)."""

    def __init__(self, executor: ConnectionExecutor, seq: int) -> None:
        self._executor = executor
        self._seq = seq
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._executor._step_output(self._seq)
        return self._output


class ConnectionExecutor(Executor):
    """Drives ``world_size`` workers, rank ``r`` over ``conns[r]`` (module doc).

    Subclasses start the workers, fill ``conns`` (and ``sentinels``: one waitable per rank that
    becomes ready when the worker's process ends, or none) and say how to describe a rank, explain
    its end and stop them all. Invariant: ``_outputs`` holds the step outputs read ahead of their
    future (at most the steps in flight); once ``_failure`` is set every call raises it. Cost per
    step: two pickles of the call (execute, sample) written to each connection and one reply read
    from the output rank.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        pc = config.parallel_config
        self.world_size = pc.world_size
        self.output_rank = pc.output_rank
        self.conns: list[Connection] = []
        self.sentinels: list[Any] = []
        self._failure: WorkerFailedError | None = None
        self._launched = itertools.count()
        self._received = 0
        self._outputs: dict[int, ModelRunnerOutput] = {}
        # The ranks hold a sampled step's reply until the next call (mp_worker._serve); the step
        # whose reply they hold, if no execute_model has followed its sample_tokens yet.
        self._defers_replies = config.async_scheduling
        self._held_seq: int | None = None

    # -- what a subclass provides -------------------------------------------------------------
    @abstractmethod
    def _describe(self, rank: int) -> str:
        """How a failure names the rank's worker (``pid 123``, ``Ray actor ... on node ...``)."""

    @abstractmethod
    def _exit_cause(self, rank: int) -> str:
        """Why rank ``rank``'s connection closed (its exit code, the signal, Ray's death cause)."""

    @abstractmethod
    def _kill_all(self) -> None:
        """Stop every worker now, without a grace period (after a failure)."""

    # -- messaging --------------------------------------------------------------------------
    def _broadcast(self, method: str, *args: Any) -> None:
        if self._failure is not None:
            raise self._failure
        message = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(message)
            except OSError:
                raise self._fail(rank, self._exit_cause(rank)) from None

    def _replies(self, ranks: range | list[int]) -> list[Any]:
        """One reply from each of ``ranks``, in rank order; raises ``WorkerFailedError`` if any
        worker reports an error or dies meanwhile."""
        if self._failure is not None:
            raise self._failure
        values: dict[int, Any] = {}
        waiting = set(ranks)
        while waiting:
            ready = wait(self.conns + self.sentinels)
            for rank, conn in enumerate(self.conns):
                if conn in ready:
                    reply = self._recv(rank)
                    if rank not in waiting:
                        raise self._fail(rank, f"an unexpected reply {reply!r:.200}")
                    values[rank] = reply
                    waiting.discard(rank)
            for rank, sentinel in enumerate(self.sentinels):
                if sentinel in ready and not self.conns[rank].poll():
                    raise self._fail(rank, self._exit_cause(rank)) from None
        return [values[r] for r in sorted(values)]

    def _recv(self, rank: int) -> Any:
        try:
            reply = self.conns[rank].recv()
        except (EOFError, OSError):
            raise self._fail(rank, self._exit_cause(rank)) from None
        if reply[0] == "error":
            raise self._fail(rank, f"an exception:\n{reply[2]}")
        return reply[1]

    def _fail(self, rank: int, cause: str) -> WorkerFailedError:
        """Record the failure, stop every worker (its peers may wait in a collective forever: no
        grace period) and return the error for the caller to raise."""
        self._failure = WorkerFailedError(f"worker rank {rank} ({self._describe(rank)}) failed: {cause}")
        self._kill_all()
        self.shutdown()
        return self._failure

    def _step_output(self, seq: int) -> ModelRunnerOutput:
        if seq == self._held_seq:  # nothing else will make the ranks send it
            self._broadcast("flush")
            self._held_seq = None
        while self._received <= seq:
            (self._outputs[self._received],) = self._replies([self.output_rank])
            self._received += 1
        return self._outputs.pop(seq)

    # -- the executor interface -----------------------------------------------------------------
    def _call_all(self, method: str, *args: Any) -> list[Any]:
        self._broadcast(method, *args)
        return self._replies(range(self.world_size))

    def determine_num_blocks(self) -> int:
        return min(self._call_all("determine_num_blocks"))

    def bytes_per_block(self) -> int:
        return self._call_all("bytes_per_block")[self.output_rank]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call_all("initialize_kv_cache", num_blocks)

    def warm_up(self) -> None:
        self._call_all("warm_up")

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._broadcast("execute_model", encode_scheduler_output(scheduler_output))
        self._held_seq = None

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> _ConnectionStepFuture:
        self._broadcast("sample_tokens", grammar_output)
        seq = next(self._launched)
        if self._defers_replies:
            self._held_seq = seq
        return _ConnectionStepFuture(self, seq)


def send_shutdown(conns: list[Connection]) -> None:
    """Ask every worker to stop (a worker whose connection is gone is skipped)."""
    message = pickle.dumps(("shutdown", ()))
    for conn in conns:
        try:
            conn.send_bytes(message)
        except OSError:
            pass
