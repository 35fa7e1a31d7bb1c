"""Executors: how the engine core reaches its workers (in this process, or one process per rank)."""

from pagedllm.config import EngineConfig
from pagedllm.executor.abstract import Executor, StepFuture
from pagedllm.executor.multiproc import MultiprocExecutor, WorkerFailedError
from pagedllm.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "MultiprocExecutor", "StepFuture", "UniProcExecutor", "WorkerFailedError", "executor_class"]


def executor_class(config: EngineConfig) -> type[Executor]:
    """The executor class for ``parallel_config.distributed_executor_backend``: ``uni`` (one worker
    in this process, no per-step overhead), ``mp`` (one spawned process per rank) or ``ray`` (one Ray
    actor per rank; imported only then, Ray being an optional extra)."""
    backend = config.parallel_config.distributed_executor_backend
    if backend == "uni":
        return UniProcExecutor
    if backend == "mp":
        return MultiprocExecutor
    if backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor
    raise ValueError(f"distributed_executor_backend={backend!r} has no executor in this build")
