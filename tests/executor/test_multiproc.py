"""The multiprocess executor at tensor_parallel_size=2 (gloo, two CPU worker processes) against the
single-process engine on a tiny random Llama: greedy ids equal (near-tie rule of
tests/engine/reference.py), under preemption, prefix caching and abort, with the block pool intact
after every step; a killed worker fails the engine loudly, and no worker outlives its engine."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from helpers import make_tiny_model  # noqa: E402

from pagedllm import EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from pagedllm.executor import MultiprocExecutor, WorkerFailedError  # noqa: E402

pytestmark = pytest.mark.timeout(240)

SHARED_PREFIX = list(range(1000, 1032))  # two full blocks: later prompts hit the prefix cache
PROMPTS = [SHARED_PREFIX + [7 * i + j for j in range(5 + 9 * i)] for i in range(8)]
# 20 blocks of 16 tokens < 8 requests x (about 50 prompt + 24 output tokens): requests get preempted.
ENGINE = dict(num_gpu_blocks_override=20, max_num_seqs=8, max_model_len=256, seed=0)
CACHED_TOKENS: dict[str, int] = {}  # request id -> prompt tokens served from the prefix cache (last run)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny_llama_tp"))


def run(engine: LLMEngine, prompts, params, abort_at: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Step ``engine`` to completion, checking the block pool after every step; ``abort_at``: abort
    request id ``k`` at step ``v``. Returns each request's output ids."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    outputs, step = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
                CACHED_TOKENS[out.request_id] = out.num_cached_tokens or 0
        engine.engine_core.scheduler.check_integrity()
        step += 1
        for req_id, at in (abort_at or {}).items():
            if at == step:
                engine.abort_request(req_id)
    return outputs


@pytest.fixture(scope="module")
def reference(tiny_folder):
    engine = LLMEngine.from_engine_args(EngineArgs(tiny_folder, **ENGINE))
    yield run(engine, PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    engine.shutdown()


@pytest.fixture(scope="module")
def tp_engine(tiny_folder):
    engine = LLMEngine.from_engine_args(EngineArgs(tiny_folder, tensor_parallel_size=2, **ENGINE))
    yield engine
    engine.shutdown()


def assert_equal_up_to_near_ties(folder, ours: dict, ref: dict) -> None:
    if ours == ref:
        return
    from reference import assert_greedy_match
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    for req_id in ref:
        assert_greedy_match(model, PROMPTS[int(req_id)], ours[req_id], ref[req_id], f"request {req_id}")


def test_tp2_greedy_equals_the_single_process_engine_under_preemption(tiny_folder, reference, tp_engine):
    assert isinstance(tp_engine.engine_core.executor, MultiprocExecutor)
    ours = run(tp_engine, PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    assert tp_engine.engine_core.scheduler.num_preemptions_total > 0  # the pool was too small
    assert_equal_up_to_near_ties(tiny_folder, ours, reference)


def test_tp2_prefix_cache_hits_and_abort_keep_outputs_and_blocks(tiny_folder, reference, tp_engine):
    ours = run(tp_engine, PROMPTS, SamplingParams(temperature=0, max_tokens=24), abort_at={"3": 2, "5": 4})
    assert max(CACHED_TOKENS.values()) >= len(SHARED_PREFIX)  # the shared prefix came from the cache
    assert set(ours) == set(reference)
    aborted = {k: ours.pop(k) for k in ("3", "5")}
    assert all(len(ids) < 24 for ids in aborted.values())
    assert_equal_up_to_near_ties(tiny_folder, ours, {k: v for k, v in reference.items() if k in ours})
    assert not tp_engine.has_unfinished_requests()


def test_tp2_seeded_sampling_equals_the_single_process_engine(tiny_folder, tp_engine):
    params = SamplingParams(temperature=1.0, top_k=50, seed=123, max_tokens=8)
    ref_engine = LLMEngine.from_engine_args(EngineArgs(tiny_folder, **ENGINE))
    try:
        ref = run(ref_engine, PROMPTS[:2], params)
    finally:
        ref_engine.shutdown()
    assert run(tp_engine, PROMPTS[:2], params) == ref


def test_tp2_with_async_scheduling_equals_the_single_process_engine(tiny_folder, reference):
    """With async scheduling the workers resolve step N only after launching step N+1's forward
    (mp_worker._serve): the outputs, preemptions and block accounting stay those of one process."""
    engine = LLMEngine.from_engine_args(EngineArgs(tiny_folder, tensor_parallel_size=2, async_scheduling=True,
                                                   **ENGINE))
    try:
        ours = run(engine, PROMPTS, SamplingParams(temperature=0, max_tokens=24), abort_at={"2": 3})
        assert not engine.has_unfinished_requests()
    finally:
        engine.shutdown()
    assert len(ours.pop("2")) < 24
    assert_equal_up_to_near_ties(tiny_folder, ours, {k: v for k, v in reference.items() if k in ours})


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_killed_worker_fails_the_engine_with_its_rank_and_leaves_no_process(tiny_folder):
    engine = LLMEngine.from_engine_args(EngineArgs(tiny_folder, tensor_parallel_size=2, **ENGINE))
    pids = [p.pid for p in engine.engine_core.executor.procs]
    engine.add_request("0", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=200))
    engine.step()
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError, match=r"worker rank 1 .*signal SIGKILL"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - t0 < 30
    with pytest.raises(WorkerFailedError, match="rank 1"):  # every later call fails the same way
        engine.step()
    assert not any(_alive(pid) for pid in pids)


def test_dropping_the_engine_stops_its_workers(tiny_folder):
    engine = LLMEngine.from_engine_args(EngineArgs(tiny_folder, tensor_parallel_size=2, **ENGINE))
    pids = [p.pid for p in engine.engine_core.executor.procs]
    assert all(_alive(pid) for pid in pids)
    del engine
    import gc

    gc.collect()
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)
