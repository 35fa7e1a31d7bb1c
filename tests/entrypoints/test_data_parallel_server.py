"""data_parallel_size=2 behind the OpenAI server (two engine processes, one API front end) on a tiny
random Llama, driven by the openai client: concurrent requests are answered and both cores get
some; killing one engine core fails the requests in flight with a 503 naming the core (never a
hang), and later requests get a 503 too."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import make_tiny_model  # noqa: E402

from pagedllm.config import EngineArgs  # noqa: E402
from pagedllm.engine.async_engine import AsyncLLMEngine  # noqa: E402
from pagedllm.engine.data_parallel import DataParallelEngines  # noqa: E402
from pagedllm.engine.engine_loop import AddCommand  # noqa: E402
from pagedllm.entrypoints.openai import api_server  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An AsyncLLMEngine with two data-parallel cores, and the request ids each core was sent."""
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("tiny_dp"))
    args = EngineArgs(folder, data_parallel_size=2, max_model_len=256, max_num_seqs=4, kv_cache_memory=16 * 2**20)
    engine = AsyncLLMEngine.from_engine_args(args, "OPENAI_API_SERVER", log_stats=False, idle_poll_s=0.05)
    assert isinstance(engine._backend, DataParallelEngines)
    sent: list[list[str]] = [[], []]
    for rank, core in enumerate(engine._backend.cores):
        def recording_send(command, send=core.send, ids=sent[rank]):
            if isinstance(command, AddCommand):
                ids.append(command.request_id)
            send(command)
        core.send = recording_send
    try:
        yield engine, sent
    finally:
        engine.shutdown(timeout_s=10)


def openai_client(engine: AsyncLLMEngine) -> openai.AsyncOpenAI:
    """The openai client on the server's app (one per event loop: the app's state binds to it)."""
    app = api_server.build_app(engine, shutdown_engine=False)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)


def test_concurrent_requests_are_spread_over_both_cores(served):
    engine, sent = served

    async def main():
        client = openai_client(engine)
        model = (await client.models.list()).data[0].id
        return await asyncio.gather(*[
            client.completions.create(model=model, prompt=f"Request number {i}:", max_tokens=8,
                                      extra_body={"ignore_eos": True})
            for i in range(8)])

    answers = asyncio.run(asyncio.wait_for(main(), timeout=120))
    assert all(a.usage.completion_tokens == 8 and a.choices[0].finish_reason == "length" for a in answers)
    assert len(sent[0]) + len(sent[1]) == 8
    assert sent[0] and sent[1], sent  # both cores got requests
    assert engine.num_running_requests() == 0 and engine.num_waiting_requests() == 0


def test_a_killed_core_is_a_503_naming_it_and_never_a_hang(served):
    engine, _ = served
    pids = list(engine._backend.pids)

    async def main():
        client = openai_client(engine)
        model = (await client.models.list()).data[0].id
        calls = [asyncio.create_task(client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=240, extra_body={"ignore_eos": True}))
            for _ in range(2)]
        while engine.num_running_requests() < 2:
            await asyncio.sleep(0.01)
        os.kill(pids[1], signal.SIGKILL)
        results = await asyncio.gather(*calls, return_exceptions=True)
        with pytest.raises(openai.APIStatusError) as after:
            await client.completions.create(model=model, prompt="Hello", max_tokens=2)
        return results, after.value

    results, after = asyncio.run(asyncio.wait_for(main(), timeout=120))
    errors = [r for r in results if isinstance(r, openai.APIStatusError)]
    assert errors, results
    assert all(e.status_code == 503 for e in errors)
    assert any("data-parallel engine core 1" in e.message and "died" in e.message for e in errors), errors
    assert after.status_code == 503
    assert not engine.is_running
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)  # the surviving core was stopped too
