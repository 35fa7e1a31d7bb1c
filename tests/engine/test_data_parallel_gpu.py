"""Data parallel on CUDA: two replicas, each on its own GPU, answer the same greedy prompt with the
same ids (same weights), and each replica's engine process holds its own device."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import make_tiny_model  # noqa: E402

from pagedllm.config import EngineArgs  # noqa: E402
from pagedllm.engine.async_engine import AsyncLLMEngine  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


def test_two_replicas_on_two_gpus_give_the_same_greedy_ids(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "tiny")
    args = EngineArgs(folder, data_parallel_size=2, dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    engine = AsyncLLMEngine.from_engine_args(args, log_stats=False, idle_poll_s=0.05)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    async def one(request_id: str) -> list[int]:
        outs = [o async for o in engine.generate({"prompt_token_ids": [1, 5, 9, 13]}, params, request_id)]
        return list(outs[-1].outputs[0].token_ids)

    async def main() -> list[list[int]]:
        return await asyncio.gather(one("a"), one("b"))

    try:
        assert [c._process.is_alive() for c in engine._backend.cores] == [True, True]
        first, second = asyncio.run(main())
    finally:
        engine.shutdown(timeout_s=10)
    assert first == second and len(first) == 16
