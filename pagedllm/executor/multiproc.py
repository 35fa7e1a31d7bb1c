"""MultiprocExecutor: one spawned worker process per rank; the scheduler stays in this process.

Each call is pickled once and written to every worker's pipe (the broadcast of the step's
``SchedulerOutput``, in the compact wire form of ``step_codec.py``: one pickle plus one pipe write
per rank; ``benchmarks/mp_broadcast.py`` times it);
the ranks join one ``torch.distributed`` world (gloo on the CPU, NCCL on CUDA) for the layers'
collectives, and only the output rank (``ParallelConfig.output_rank``) sends a step's
``ModelRunnerOutput`` back (``mp_worker.py`` says which calls reply).

Failure: while it waits for a reply the driver also watches every worker's pipe and process; a
worker that reports an exception or exits makes the call raise ``WorkerFailedError`` naming the rank
and the cause (traceback or exit code), and every later call raises the same error: the engine
fails loudly rather than hang. Shutdown (explicit, or when the executor is garbage-collected, or at
interpreter exit) asks the workers to stop, then terminates and kills what is left: no orphans.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import weakref
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor
from pagedllm.executor.mp_worker import worker_main
from pagedllm.executor.step_codec import encode_scheduler_output
from pagedllm.sample.bitmask import GrammarOutput

_STOP_GRACE_S = 5.0


class WorkerFailedError(RuntimeError):
    """A worker process raised or exited; the message names its rank and the cause."""


class _MultiprocStepFuture:
    """The output of the ``seq``-th sampled step; ``result()`` reads the output rank's replies in
    order until its own has arrived (steps are launched and their results read in the same order)."""

    def __init__(self, executor: MultiprocExecutor, seq: int) -> None:
        self._executor = executor
        self._seq = seq
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._executor._step_output(self._seq)
        return self._output


class MultiprocExecutor(Executor):
    """Drives ``world_size`` worker processes (module doc).

    Invariant: ``procs[r]`` and ``conns[r]`` are rank ``r``'s process and pipe; ``_outputs`` holds
    the step outputs read ahead of their future (at most the steps in flight). Once ``_failure`` is
    set every call raises it. Cost per step: two pickles of the call (execute, sample) written to
    each pipe and one reply read from the output rank.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        pc = config.parallel_config
        self.world_size = pc.world_size
        self.output_rank = pc.output_rank
        self._store_dir = tempfile.mkdtemp(prefix="pagedllm-dist-")
        init_method = "file://" + os.path.join(self._store_dir, "store")
        ctx = multiprocessing.get_context("spawn")
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self._failure: WorkerFailedError | None = None
        self._launched = itertools.count()
        self._received = 0
        self._outputs: dict[int, ModelRunnerOutput] = {}
        with _children_allowed():
            for rank in range(self.world_size):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(target=worker_main, args=(config, rank, init_method, child_end, os.getpid()),
                                   name=f"pagedllm-worker-{rank}", daemon=True)
                proc.start()
                child_end.close()
                self.procs.append(proc)
                self.conns.append(parent_end)
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns, self._store_dir)
        self._replies(range(self.world_size))  # every rank built its model (or the failure is raised)

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
            ready = wait(self.conns + [p.sentinel for p in self.procs])
            for rank, conn in enumerate(self.conns):
                if conn in ready:
                    reply = self._recv(rank)
                    if rank not in waiting:
                        raise self._fail(rank, f"an unexpected reply {reply!r:.200}")
                    values[rank] = reply
                    waiting.discard(rank)
            for rank, proc in enumerate(self.procs):
                if proc.sentinel in ready and not self.conns[rank].poll():
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

    def _exit_cause(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(timeout=1.0)
        code = proc.exitcode
        if code is None:
            return "a closed pipe (the process is still running)"
        if code < 0:
            return f"exit by signal {signal.Signals(-code).name}"
        return f"exit code {code}"

    def _fail(self, rank: int, cause: str) -> WorkerFailedError:
        """Record the failure, stop every worker (its peers may wait in a collective forever: no
        grace period) and return the error for the caller to raise."""
        self._failure = WorkerFailedError(f"worker rank {rank} (pid {self.procs[rank].pid}) failed: {cause}")
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        self.shutdown()
        return self._failure

    def _step_output(self, seq: int) -> ModelRunnerOutput:
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

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> _MultiprocStepFuture:
        self._broadcast("sample_tokens", grammar_output)
        return _MultiprocStepFuture(self, next(self._launched))

    def shutdown(self) -> None:
        self._finalizer()


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """Let a daemon process (the server's engine process) start the workers: multiprocessing
    forbids daemons children because it could not stop them, but this executor stops its own
    (its finalizer at exit, and each worker's watch on its parent)."""
    config = multiprocessing.current_process()._config
    daemon = config.get("daemon", False)
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = daemon


def _stop_workers(procs: list, conns: list[Connection], store_dir: str) -> None:
    """Ask every worker to stop, wait a grace period, then terminate and kill what is left."""
    message = pickle.dumps(("shutdown", ()))
    for conn in conns:
        try:
            conn.send_bytes(message)
        except OSError:
            pass
    for proc in procs:
        proc.join(timeout=_STOP_GRACE_S)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=_STOP_GRACE_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
    shutil.rmtree(store_dir, ignore_errors=True)
