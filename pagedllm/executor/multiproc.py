"""MultiprocExecutor: one spawned worker process per rank; the scheduler stays in this process.

The calls travel over one pipe per worker (``conn_executor.py``: one pickle plus one pipe write per
rank for each step's ``SchedulerOutput``; ``benchmarks/mp_broadcast.py`` times it); the ranks join
one ``torch.distributed`` world (gloo on the CPU, NCCL on CUDA) for the layers' collectives, through
a file store in a temporary folder.

Failure: besides the pipes the driver watches every worker's process sentinel, so a worker that
exits is reported with its exit code or signal. Shutdown (explicit, or when the executor is
garbage-collected, or at interpreter exit) asks the workers to stop, then terminates and kills what
is left: no orphans.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import tempfile
import weakref
from collections.abc import Iterator
from multiprocessing.connection import Connection

from pagedllm.config import EngineConfig
from pagedllm.executor.conn_executor import ConnectionExecutor, WorkerFailedError, send_shutdown
from pagedllm.executor.mp_worker import worker_main

__all__ = ["MultiprocExecutor", "WorkerFailedError"]

_STOP_GRACE_S = 5.0


class MultiprocExecutor(ConnectionExecutor):
    """Drives ``world_size`` spawned worker processes (module doc).

    Invariant: ``procs[r]``, ``conns[r]`` and ``sentinels[r]`` are rank ``r``'s process, pipe and
    process sentinel. Cost per step: that of ``ConnectionExecutor``.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._store_dir = tempfile.mkdtemp(prefix="pagedllm-dist-")
        init_method = "file://" + os.path.join(self._store_dir, "store")
        ctx = multiprocessing.get_context("spawn")
        self.procs: list[multiprocessing.process.BaseProcess] = []
        with _children_allowed():
            for rank in range(self.world_size):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(target=worker_main, args=(config, rank, init_method, child_end, os.getpid()),
                                   name=f"pagedllm-worker-{rank}", daemon=True)
                proc.start()
                child_end.close()
                self.procs.append(proc)
                self.conns.append(parent_end)
                self.sentinels.append(proc.sentinel)
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns, self._store_dir)
        self._replies(range(self.world_size))  # every rank built its model (or the failure is raised)

    def _describe(self, rank: int) -> str:
        return f"pid {self.procs[rank].pid}"

    def _exit_cause(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(timeout=1.0)
        code = proc.exitcode
        if code is None:
            return "a closed pipe (the process is still running)"
        if code < 0:
            return f"exit by signal {signal.Signals(-code).name}"
        return f"exit code {code}"

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()

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
    send_shutdown(conns)
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
