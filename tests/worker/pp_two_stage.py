"""Both stages of a pipeline of 2 in ONE process: the real workers, runners, CUDA graphs and engine
core, with the residual stream handed from stage 0 to stage 1 in memory.

Why in one process: only one-GPU machines are lent, and NCCL refuses two ranks on one device
(and gloo cannot send CUDA tensors); the multiprocess executor puts rank r on ``cuda:r``. What
this leaves out is the ``torch.distributed`` send / receive themselves, which the CPU gloo tests
(``tests/executor/test_pipeline_parallel.py``) run; everything a stage does around them (the
receive into a graph's static input rows, the replay, the send from its static output) is the
production code. ``InMemoryStage`` overrides only the two transfer methods of
``PipelineParallelGroup``; ``TwoStageExecutor`` is the executor interface over the two workers.

Usage: ``two_stage_engine(EngineArgs(...))``, an ``LLMEngine`` of ``pipeline_parallel_size=2`` (so
the engine core keeps two micro-batches in flight) over a ``TwoStageExecutor``.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from unittest import mock

import torch

from pagedllm import EngineArgs, LLMEngine
from pagedllm.attention.backend import CommonAttentionInputs, forward_context
from pagedllm.distributed import PipelineParallelGroup, set_pp_group
from pagedllm.engine import engine_core
from pagedllm.engine.config_builder import create_engine_config
from pagedllm.executor.abstract import Executor
from pagedllm.worker.cuda_graph import CUDAGraphRunner
from pagedllm.worker.worker import Worker
from tests.helpers import TINY_INIT_STD, tiny_config


def make_pp_model(folder, arch: str = "llama", num_layers: int = 4, seed: int = 0) -> str:
    """A tiny random ``arch`` checkpoint (float32 safetensors, no tokenizer: run it with
    ``skip_tokenizer_init``) with ``num_layers`` decoder layers, split evenly by 2 stages."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch)
    cfg.num_hidden_layers = num_layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.1) if "norm" in name else param.normal_(0.0, TINY_INIT_STD)
    model.save_pretrained(str(folder))
    return str(folder)


@dataclasses.dataclass(frozen=True)
class InMemoryStage(PipelineParallelGroup):
    """A stage whose sends append to ``link`` and whose receives pop from it (stage 0 always runs
    a step before stage 1, so the queue holds the tensors in step order)."""

    link: deque = dataclasses.field(default_factory=deque, compare=False)

    def send_next(self, x: torch.Tensor) -> None:
        self.link.append(x.clone())  # x may be a graph's static output, overwritten by the next replay

    def recv_prev_into(self, out: torch.Tensor) -> torch.Tensor:
        x = self.link.popleft()
        assert x.shape == out.shape, f"stage {self.stage} expected {tuple(out.shape)}, got {tuple(x.shape)}"
        return out.copy_(x)


class _BothStages:
    """A step's future: stage 0's handle (it samples nothing) resolved before stage 1's."""

    def __init__(self, first, last) -> None:
        self.first, self.last = first, last

    def result(self):
        self.first.result()
        return self.last.result()


class TwoStageExecutor(Executor):
    """Workers of stages 0 and 1 in this process, on one device (module doc). Each call runs stage 0,
    then stage 1; the KV cache gets the smaller of their block counts (set
    ``num_gpu_blocks_override`` on CUDA: both stages share the GPU's memory)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        if config.device.startswith("cuda:"):
            torch.cuda.set_device(torch.device(config.device))
        link: deque = deque()
        self.stages: list[Worker] = []
        for stage in range(2):
            previous = set_pp_group(InMemoryStage(stage=stage, size=2, world_rank=stage, tp_size=1, link=link))
            try:
                self.stages.append(Worker(config))
            finally:
                set_pp_group(previous)
        self.link = link

    def determine_num_blocks(self) -> int:
        return min(w.determine_num_blocks() for w in self.stages)

    def bytes_per_block(self) -> int:
        return max(w.bytes_per_block() for w in self.stages)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        for w in self.stages:
            w.initialize_kv_cache(num_blocks)

    def warm_up(self) -> None:
        for w in self.stages:
            w.warm_up()
        assert not self.link, "start-up must not communicate"

    def execute_model(self, scheduler_output) -> None:
        for w in self.stages:
            w.execute_model(scheduler_output)
        assert not self.link, "stage 1 did not take what stage 0 sent"

    def sample_tokens(self, grammar_output=None):
        first = self.stages[0].sample_tokens(grammar_output)
        return _BothStages(first, self.stages[1].sample_tokens(grammar_output))

    def shutdown(self) -> None:
        for w in self.stages:
            w.shutdown()


def two_stage_engine(args: EngineArgs) -> LLMEngine:
    """The engine of ``args`` (``pipeline_parallel_size`` 1) as a pipeline of 2 stages in this process.
    The config is resolved at one stage and then given 2 (a CUDA config of 2 stages would be refused
    on a host of one GPU); the model's layers must divide by 2."""
    config = create_engine_config(args)
    parallel = dataclasses.replace(config.parallel_config, pipeline_parallel_size=2, distributed_executor_backend="mp")
    config = dataclasses.replace(config, parallel_config=parallel)
    with mock.patch.object(engine_core, "executor_class", lambda config: TwoStageExecutor):
        return LLMEngine(config)


class EagerStageReplay(CUDAGraphRunner):
    """A "graph" for the CPU: ``replay`` runs the stage's graph forward (``_forward``, static input
    rows included) eagerly over the inputs staged for the replayed shape, so ``replay_stage`` and the
    runner's graph path run as on CUDA. Records each ``(bs, num_tokens)`` replayed and the shapes
    of the outputs."""

    def __init__(self, worker: Worker) -> None:
        runner = worker.model_runner
        super().__init__(worker.model, worker.backend, runner.prep.inputs, runner.input_batch.max_num_reqs,
                         worker.device, pp=runner.pp, dtype=worker.dtype)
        self.replays: list[tuple[int, int]] = []
        self.output_shapes: set[tuple[int, ...]] = set()

    def replay_stage(self, bs: int, q: int, num_tokens: int) -> torch.Tensor | None:
        self.replays.append((bs, num_tokens))
        return super().replay_stage(bs, q, num_tokens)

    def replay(self, bs: int, q: int = 1) -> torch.Tensor:
        stage = self.inputs.np
        assert len(stage["seq_lens"]) == bs and len(stage["input_ids"]) == bs * q, "staged for another shape"
        dev = {name: torch.from_numpy(a) for name, a in stage.items()}
        common = CommonAttentionInputs(
            num_actual_tokens=bs * q, max_query_len=q, query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"], block_tables=self.inputs.block_tables[:bs], slot_mapping=dev["slot_mapping"],
            query_start_loc_host=stage["query_start_loc"], seq_lens_host=stage["seq_lens"])
        with forward_context(self.backend.metadata_builder.build(common), self.backend):
            out = self._forward(dev["input_ids"], dev["positions"]).clone()
        self.output_shapes.add(tuple(out.shape))
        return out
