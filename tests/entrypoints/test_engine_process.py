"""AsyncLLMEngine with the engine in a child process (engine_proc.py), on the embedded model (CPU).

Checks: a request streams; an abort ends the stream and frees the engine's blocks; a start-up
error comes back with the child's message; a killed child fails the request in flight (never a
hang) and marks the engine dead; shutdown leaves no child behind; the server with
--engine-process stops with exit status 1 when its engine dies, and a killed server leaves no
engine process behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from pagedllm.config import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.engine.config_builder import create_engine_config
from pagedllm.engine.engine_proc import EngineProcessError
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.timeout(300)

ENGINE_ARGS = EngineArgs(max_model_len=512, kv_cache_memory=64 * 2**20, max_num_seqs=8)


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


def _start() -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(ENGINE_ARGS, engine_process=True, log_stats=False, idle_poll_s=0.05)


def _engine_pid(engine: AsyncLLMEngine) -> int:
    return engine._backend.pid


@pytest.fixture(scope="module")
def engine():
    engine = _start()
    yield engine
    engine.shutdown(timeout_s=10)


def test_a_request_streams_from_the_child(engine):
    async def main():
        return [o async for o in engine.generate("The capital of France is", _params(6), "stream")]

    outs = asyncio.run(main())
    assert len(outs) >= 2 and outs[-1].finished
    assert outs[-1].outputs[0].finish_reason == "length"
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 6
    assert "".join(o.outputs[0].text for o in outs).strip()
    assert _engine_pid(engine) != os.getpid()


def test_a_validation_error_comes_back_unchanged(engine):
    async def main():
        with pytest.raises(ValueError, match="max_model_len|maximum"):
            async for _ in engine.generate("x " * 600, _params(4), "too-long"):
                pass

    asyncio.run(main())
    assert engine.is_running


def test_abort_ends_the_stream_and_frees_the_blocks(engine):
    async def main():
        outs = []
        async for out in engine.generate("Once upon a time", _params(400), "long"):
            outs.append(out)
            if len(outs) == 3:
                await engine.abort("long")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    deadline = time.monotonic() + 10
    while engine.num_running_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_running_requests() == 0 and engine.num_live_requests() == 0
    usage = [s.value for fam in engine.metrics.registry.collect() for s in fam.samples
             if s.name == "pagedllm:kv_cache_usage_perc"]
    assert usage == [0.0]


def test_a_startup_error_is_raised_with_the_childs_message():
    config = dataclasses.replace(create_engine_config(ENGINE_ARGS), attention_backend="no-such-backend")
    with pytest.raises(EngineProcessError, match="no-such-backend"):
        AsyncLLMEngine(config, log_stats=False)


def test_a_killed_child_fails_the_request_in_flight_and_the_engine():
    engine = _start()
    pid = _engine_pid(engine)

    async def main():
        outs = []
        with pytest.raises(EngineDeadError, match="died"):
            async for out in engine.generate("Once upon a time", _params(400), "victim"):
                outs.append(out)
                if len(outs) == 2:
                    os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await engine.generate("late", _params(2), "late").__anext__()

    try:
        asyncio.run(asyncio.wait_for(main(), timeout=60))
        assert engine.errored and not engine.is_running
    finally:
        engine.shutdown(timeout_s=5)


def test_shutdown_leaves_no_child():
    engine = _start()
    pid = _engine_pid(engine)
    assert psutil.pid_exists(pid)
    engine.shutdown(timeout_s=10)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not [c for c in psutil.Process().children() if c.pid == pid]
    assert not engine.is_running


def test_server_stops_when_its_engine_process_dies(tmp_path):
    proc, url, log = _start_server(tmp_path)
    try:
        children = _engine_children(proc)
        assert len(children) == 1, children
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            children[0].kill()
            rest = list(lines)  # the stream ends (with an error event), it does not hang
        assert any("error" in line for line in rest), rest
        assert proc.wait(timeout=30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.seek(0)
        print(log.read()[-3000:])
        log.close()


def test_a_killed_server_leaves_no_engine_process(tmp_path):
    proc, url, log = _start_server(tmp_path)
    try:
        (child,) = _engine_children(proc)
        proc.kill()  # no clean-up runs in the server: the child must notice its pipe close
        proc.wait(30)
        child.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def _start_server(tmp_path):
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = open(tmp_path / "server.log", "w+")
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--engine-process", "--max-model-len", "512", "--kv-cache-memory", str(64 * 2**20),
           "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", "--shutdown-timeout", "2"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(proc, url, log)
    return proc, url, log


def _engine_children(proc: subprocess.Popen) -> list[psutil.Process]:
    """The spawned engine process (not multiprocessing's resource tracker)."""
    return [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, log, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError("server not ready")
