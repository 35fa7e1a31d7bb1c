"""The server's engine (AsyncLLMEngine in its own daemon process) at tensor_parallel_size=2: the
engine process starts its two workers, a request streams, a killed worker fails the request in
flight with its rank and cause and marks the engine dead (never a hang: the server answers 503), and
shutdown leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import make_tiny_model  # noqa: E402

from pagedllm.config import EngineArgs  # noqa: E402
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError  # noqa: E402
from pagedllm.executor import WorkerFailedError  # noqa: E402
from pagedllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0,
                          output_kind=RequestOutputKind.DELTA)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _descendants(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]


def test_engine_process_with_two_workers_streams_then_fails_loudly_and_cleans_up(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "tiny")
    args = EngineArgs(folder, tensor_parallel_size=2, max_model_len=256, num_gpu_blocks_override=64)
    engine = AsyncLLMEngine.from_engine_args(args, engine_process=True, log_stats=False, idle_poll_s=0.05)
    engine_pid = engine._backend.pid
    try:
        workers = _descendants(engine_pid)
        assert len(workers) == 2, workers

        async def generate(request_id: str, max_tokens: int) -> list:
            params = _params(max_tokens)
            return [o async for o in engine.generate({"prompt_token_ids": [1, 2, 3, 4]}, params, request_id)]

        outs = asyncio.run(generate("ok", 5))
        assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 5

        async def killed_mid_run() -> None:
            stream = engine.generate({"prompt_token_ids": [5, 6, 7]}, _params(200), "killed")
            await stream.__anext__()
            os.kill(workers[1].pid, signal.SIGKILL)
            async for _ in stream:
                pass

        with pytest.raises(WorkerFailedError, match=r"worker rank 1 .*SIGKILL"):
            asyncio.run(asyncio.wait_for(killed_mid_run(), timeout=60))
        with pytest.raises(EngineDeadError):  # the server answers 503 from now on
            asyncio.run(asyncio.wait_for(generate("after", 2), timeout=60))
    finally:
        engine.shutdown(timeout_s=10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(p) for p in [engine_pid, *(w.pid for w in workers)]):
        time.sleep(0.1)
    assert not any(_alive(p) for p in [engine_pid, *(w.pid for w in workers)])
