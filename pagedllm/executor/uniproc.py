"""UniProcExecutor: one worker in the engine core's own process; every call is a method call."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.executor.abstract import Executor, StepFuture
from pagedllm.sample.bitmask import GrammarOutput
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    """Holds one ``Worker`` (rank 0 of a world of one).

    Invariant: ``self.worker`` lives as long as the executor. Cost: one Python call per method on
    top of the worker's.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        if config.device.startswith("cuda:"):
            import torch

            # e.g. a data-parallel replica's own GPU: Triton launches on the current device.
            torch.cuda.set_device(torch.device(config.device))
        self.worker = Worker(config)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def bytes_per_block(self) -> int:
        return self.worker.bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def warm_up(self) -> None:
        self.worker.warm_up()

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.worker.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> StepFuture:
        return self.worker.sample_tokens(grammar_output)

    def shutdown(self) -> None:
        self.worker.shutdown()
