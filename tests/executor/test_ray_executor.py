"""The Ray executor (distributed_executor_backend="ray") on a local Ray cluster, two CPU actors
(gloo), on a tiny random Qwen3 (2 decoder layers): TP=2 and PP=2 give the single-process engine's
greedy ids; an actor killed mid-run fails the engine with its rank; an engine that started its own
Ray instance leaves neither actors nor the instance behind."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import make_tiny_model  # noqa: E402
from test_multiproc import ENGINE, PROMPTS, _alive, assert_equal_up_to_near_ties, run  # noqa: E402

from pagedllm import EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from pagedllm.executor import WorkerFailedError  # noqa: E402
from pagedllm.executor.ray_executor import RayExecutor  # noqa: E402

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The tiny Qwen3 folder and the single-process engine's greedy outputs for PROMPTS."""
    folder = make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3_ray"))
    reference = LLMEngine.from_engine_args(EngineArgs(folder, **ENGINE))
    try:
        return folder, run(reference, PROMPTS, GREEDY)
    finally:
        reference.shutdown()


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray instance for the module: the executors join it and leave it running."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def test_started_ray_instance_is_stopped_with_the_engine(qwen3):
    folder, expected = qwen3
    assert not ray.is_initialized()
    engine = LLMEngine.from_engine_args(EngineArgs(folder, tensor_parallel_size=2, distributed_executor_backend="ray",
                                                   **ENGINE))
    executor = engine.engine_core.executor
    assert isinstance(executor, RayExecutor) and ray.is_initialized()
    pids = list(executor.pids)
    assert os.getpid() not in pids and all(_alive(p) for p in pids)
    ours = run(engine, PROMPTS[:2], GREEDY)
    engine.shutdown()
    assert_equal_up_to_near_ties(folder, ours, {k: expected[k] for k in ours})
    assert not ray.is_initialized()  # it started the instance, so it stopped it
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


@pytest.mark.parametrize("sizes", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"])
def test_ray_greedy_equals_the_single_process_engine(qwen3, ray_cluster, sizes):
    folder, expected = qwen3
    engine = LLMEngine.from_engine_args(EngineArgs(folder, distributed_executor_backend="ray", **sizes, **ENGINE))
    try:
        assert isinstance(engine.engine_core.executor, RayExecutor)
        ours = run(engine, PROMPTS, GREEDY)
        assert engine.engine_core.scheduler.num_preemptions_total > 0
    finally:
        engine.shutdown()
    assert ray.is_initialized()  # a cluster the executor joined stays up
    assert_equal_up_to_near_ties(folder, ours, expected)


def test_killed_actor_fails_the_engine_with_its_rank(qwen3, ray_cluster):
    folder, _ = qwen3
    engine = LLMEngine.from_engine_args(EngineArgs(folder, tensor_parallel_size=2, distributed_executor_backend="ray",
                                                   **ENGINE))
    pids = list(engine.engine_core.executor.pids)
    engine.add_request("0", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=200))
    engine.step()
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError, match=rf"worker rank 1 \(Ray actor, pid {pids[1]}\) failed: the actor died"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - t0 < 60
    with pytest.raises(WorkerFailedError, match="rank 1"):  # every later call fails the same way
        engine.step()
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_more_ranks_than_the_cluster_holds_is_refused_at_once(qwen3, ray_cluster):
    folder, _ = qwen3
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"needs 4 CPUs, the Ray cluster has 2"):
        LLMEngine.from_engine_args(EngineArgs(folder, tensor_parallel_size=2, pipeline_parallel_size=2,
                                              distributed_executor_backend="ray", **ENGINE))
    assert time.monotonic() - t0 < 30
    assert ray.is_initialized()
    groups = ray.util.placement_group_table().values()
    assert all(group["state"] == "REMOVED" for group in groups), groups  # none left behind
