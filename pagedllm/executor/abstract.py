"""The executor interface: what the engine core asks of the workers, in plain data.

Everything that crosses this boundary is plain Python (``SchedulerOutput`` down, a future of a
``ModelRunnerOutput`` back, ints for KV sizing), so a multiprocess or Ray executor can implement it
by broadcasting the same calls to one worker per rank and answering with the driver rank's output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.sample.bitmask import GrammarOutput


class StepFuture(Protocol):
    """One launched step. ``result()`` waits for its tokens (once; later calls return the same
    output)."""

    def result(self) -> ModelRunnerOutput: ...


class Executor(ABC):
    """Runs the model for the engine core.

    Invariant: calls arrive in start-up order (``determine_num_blocks`` -> ``initialize_kv_cache``
    -> ``warm_up``), then per step ``execute_model`` followed by exactly one ``sample_tokens``.
    Cost: the calls themselves are thin; each costs what the workers' matching call costs plus,
    for out-of-process executors, one message per worker.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks every worker can hold (the minimum over workers)."""

    @abstractmethod
    def bytes_per_block(self) -> int:
        """Bytes of one KV block on one worker (all layers, keys and values)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks on every worker."""

    @abstractmethod
    def warm_up(self) -> None:
        """Run the start-up stages that need the KV cache (warm-up, GEMM tuning, graph capture)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Launch the step's forward pass (inputs, model, logits); returns without waiting."""

    @abstractmethod
    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> StepFuture:
        """Sample the step launched by ``execute_model`` (``grammar_output``: an optional token
        bitmask applied to its logits first) and return its future."""

    @abstractmethod
    def shutdown(self) -> None:
        """Wait for the device and release the workers."""
