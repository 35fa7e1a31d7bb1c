"""Executors: how the engine core reaches its workers (one in-process worker today)."""

from pagedllm.config import EngineConfig
from pagedllm.executor.abstract import Executor, StepFuture
from pagedllm.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "StepFuture", "UniProcExecutor", "executor_class"]


def executor_class(config: EngineConfig) -> type[Executor]:
    """The executor class for ``parallel_config.distributed_executor_backend``."""
    backend = config.parallel_config.distributed_executor_backend
    if backend != "uni":
        raise ValueError(f"distributed_executor_backend={backend!r} has no executor in this build")
    return UniProcExecutor
