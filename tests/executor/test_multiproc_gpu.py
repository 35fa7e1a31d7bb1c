"""The multiprocess and Ray executors on CUDA (NCCL): one rank in a worker process (or a Ray actor
holding one GPU) equals the in-process engine; with two GPUs, tensor_parallel_size=2 too (float32,
so ids agree up to near-ties)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import make_tiny_model  # noqa: E402
from test_multiproc import PROMPTS, assert_equal_up_to_near_ties, run  # noqa: E402

from pagedllm import EngineArgs, LLMEngine, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
ENGINE = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, max_num_seqs=8)


def _outputs(folder: str, **parallel) -> dict[str, list[int]]:
    engine = LLMEngine.from_engine_args(EngineArgs(folder, **ENGINE, **parallel))
    try:
        return run(engine, PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("parallel", [
    dict(distributed_executor_backend="mp"),
    pytest.param(dict(tensor_parallel_size=2), marks=pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs two GPUs")),
    dict(distributed_executor_backend="ray"),
    pytest.param(dict(tensor_parallel_size=2, distributed_executor_backend="ray"), marks=pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs two GPUs")),
])
def test_multiproc_on_cuda_equals_the_in_process_engine(tmp_path, parallel):
    folder = make_tiny_model("llama", tmp_path / "tiny")
    assert_equal_up_to_near_ties(folder, _outputs(folder, **parallel), _outputs(folder))
