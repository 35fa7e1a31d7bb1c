"""Executors: how the engine core reaches its workers (one in-process worker today)."""

from pagedllm.executor.abstract import Executor, StepFuture
from pagedllm.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "StepFuture", "UniProcExecutor"]
