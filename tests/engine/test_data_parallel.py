"""DataParallelEngines without processes (the engine processes replaced by recorders): requests go
to the least loaded core (4 x waiting + running, plus what was sent since its last report), ties
round-robin, a live id to its own core; aborts reach only the core that holds the request; step
reports carry the stats merged over the cores; a dead core ends the engine once, naming it, and a
stop ends it when every core has stopped. LLM and LLMEngine refuse data_parallel_size > 1."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.config import (  # noqa: E402
    CacheConfig,
    EngineArgs,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedllm.core.scheduler import SchedulerStats, SpecDecodingStats  # noqa: E402
from pagedllm.engine import data_parallel  # noqa: E402
from pagedllm.engine.data_parallel import DataParallelEngines, merge_scheduler_stats, replica_config  # noqa: E402
from pagedllm.engine.engine_loop import (  # noqa: E402
    AbortCommand,
    Accepted,
    AddCommand,
    LoopEnded,
    Refused,
    StepReport,
    StopCommand,
)
from pagedllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402


class FakeCore:
    """Stands for an EngineProcess: records the commands; the test emits its events."""

    def __init__(self, config, on_event, idle_poll_s, num_processes) -> None:
        assert num_processes == 2  # the replicas split the CPU threads
        self.config = config
        self.emit = on_event
        self.commands: list = []
        self.pid = 1000 + len(CORES)
        self.stopped = False
        CORES.append(self)

    def send(self, command) -> None:
        self.commands.append(command)

    def is_alive(self) -> bool:
        return not self.stopped

    def shutdown(self, timeout_s: float) -> None:
        self.stopped = True


CORES: list[FakeCore] = []


def _config(dp: int, device: str = "cpu", tp: int = 1) -> EngineConfig:
    return EngineConfig(model_config=ModelConfig("m", None, None, "float32", 64), cache_config=CacheConfig(16, 0),
                        scheduler_config=SchedulerConfig(4, 64, 64), device=device, enforce_eager=True,
                        attention_backend="auto", max_logprobs=5,
                        parallel_config=ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp))


@pytest.fixture
def engines(monkeypatch):
    CORES.clear()
    monkeypatch.setattr(data_parallel, "EngineProcess", FakeCore)
    events: list = []
    dp = DataParallelEngines(_config(2), events.append)
    return dp, events


def _add(add_id: int, request_id: str, n: int = 1) -> AddCommand:
    return AddCommand(add_id, request_id, [1, 2, 3], SamplingParams(n=n, max_tokens=4))


def _stats(waiting: int, running: int, **kw) -> SchedulerStats:
    return SchedulerStats(num_running=running, num_waiting=waiting, kv_cache_usage=kw.get("kv", 0.0),
                          prefix_cache_queries=kw.get("q", 0), prefix_cache_hits=kw.get("h", 0),
                          num_preemptions_total=kw.get("p", 0), spec_decoding=kw.get("spec"))


def _finished(request_id: str) -> RequestOutput:
    return RequestOutput(request_id, None, [1, 2, 3], None,
                         [CompletionOutput(0, "", [4], None, None, "length")], finished=True)


def _adds(core: FakeCore) -> list[str]:
    return [c.request_id for c in core.commands if isinstance(c, AddCommand)]


def test_replicas_get_their_own_gpus_and_one_core_each():
    config = _config(2, device="cuda:2", tp=2)
    assert [replica_config(config, r).device for r in range(2)] == ["cuda:2", "cuda:4"]
    assert replica_config(config, 1).parallel_config.data_parallel_size == 1
    assert replica_config(_config(2), 1).device == "cpu"


def test_requests_go_to_the_least_loaded_core(engines):
    dp, _ = engines
    for i in range(4):  # equal loads: round-robin
        dp.send(_add(i, f"r{i}"))
    assert _adds(CORES[0]) == ["r0", "r2"] and _adds(CORES[1]) == ["r1", "r3"]
    CORES[0].emit(StepReport([], _stats(waiting=0, running=2)))  # score 2
    CORES[1].emit(StepReport([], _stats(waiting=1, running=1)))  # score 5
    dp.send(_add(4, "r4"))
    dp.send(_add(5, "r5", n=2))  # core 0: 2 + 4 = 6 > 5 now: core 1
    assert _adds(CORES[0]) == ["r0", "r2", "r4"] and _adds(CORES[1]) == ["r1", "r3", "r5"]


def test_a_live_id_goes_back_to_its_core_and_is_freed_when_refused_or_finished(engines):
    dp, events = engines
    dp.send(_add(0, "same"))
    CORES[0].emit(Accepted(0))
    CORES[0].emit(StepReport([], _stats(waiting=5, running=4)))
    dp.send(_add(1, "same"))  # the duplicate goes where the engine can refuse it
    assert _adds(CORES[0]) == ["same", "same"]
    CORES[0].emit(Refused(1, ValueError("request id 'same' is already live")))
    dp.send(AbortCommand(["same"]))
    assert isinstance(CORES[0].commands[-1], AbortCommand) and not CORES[1].commands
    CORES[0].emit(StepReport([_finished("same")], _stats(waiting=5, running=4)))
    dp.send(_add(2, "same"))  # finished: a new request, routed by load
    assert _adds(CORES[1]) == ["same"]
    assert [type(e).__name__ for e in events] == ["Accepted", "StepReport", "Refused", "StepReport"]


def test_an_abort_reaches_only_the_core_of_its_add(engines):
    dp, _ = engines
    dp.send(_add(0, "a"))
    dp.send(_add(1, "b"))
    dp.send(AbortCommand(["b"], add_id=1))
    dp.send(AbortCommand(["unknown"]))
    assert [type(c).__name__ for c in CORES[0].commands] == ["AddCommand"]
    assert [type(c).__name__ for c in CORES[1].commands] == ["AddCommand", "AbortCommand"]


def test_step_reports_carry_the_stats_merged_over_the_cores(engines):
    dp, events = engines
    spec = SpecDecodingStats(num_drafts=2, num_draft_tokens=4, num_accepted_tokens=3, num_accepted_tokens_per_pos=[2, 1])
    CORES[0].emit(StepReport([], _stats(1, 2, kv=0.5, q=10, h=4, p=1, spec=spec)))
    CORES[1].emit(StepReport([], _stats(3, 4, kv=0.25, q=6, h=2, p=0, spec=SpecDecodingStats(1, 1, 1, [1]))))
    merged = events[-1].scheduler_stats
    assert (merged.num_waiting, merged.num_running, merged.kv_cache_usage) == (4, 6, 0.375)
    assert (merged.prefix_cache_queries, merged.prefix_cache_hits, merged.num_preemptions_total) == (16, 6, 1)
    assert dataclasses.astuple(merged.spec_decoding) == (3, 5, 4, [3, 1])
    assert merge_scheduler_stats([_stats(1, 2)]) == _stats(1, 2)


def test_a_dead_core_ends_the_engine_once_and_stops_the_others(engines):
    dp, events = engines
    CORES[1].emit(LoopEnded("the engine process died (exit code -9)"))
    assert events == [LoopEnded("data-parallel engine core 1 (pid 1001): the engine process died (exit code -9)")]
    CORES[0].emit(StepReport([], _stats(0, 0)))
    CORES[0].emit(LoopEnded(None))
    assert len(events) == 1 and not dp.is_alive()
    import time

    deadline = time.monotonic() + 5
    while not CORES[0].stopped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert CORES[0].stopped


def test_a_stop_ends_the_engine_when_every_core_has_stopped(engines):
    dp, events = engines
    dp.send(StopCommand())
    assert all(isinstance(core.commands[-1], StopCommand) for core in CORES)
    CORES[0].emit(LoopEnded(None))
    assert events == []
    CORES[1].emit(LoopEnded(None))
    assert events == [LoopEnded(None)]


def test_llm_engine_refuses_data_parallel(tmp_path):
    from helpers import make_tiny_model

    from pagedllm import LLM

    folder = make_tiny_model("llama", tmp_path / "tiny")
    with pytest.raises(ValueError, match=r"^data_parallel_size \(2\) needs one engine core per replica"):
        LLM(folder, data_parallel_size=2)
    assert EngineArgs(folder, data_parallel_size=2).data_parallel_size == 2


def test_a_core_dead_before_every_core_is_ready_fails_the_start(monkeypatch):
    from pagedllm.engine.engine_proc import EngineProcessError

    class DyingCore(FakeCore):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if len(CORES) == 1:
                self.emit(LoopEnded("the engine process died (exit code -9)"))

    CORES.clear()
    monkeypatch.setattr(data_parallel, "EngineProcess", DyingCore)
    with pytest.raises(EngineProcessError, match="died during start-up"):
        DataParallelEngines(_config(2), [].append)
    assert all(core.stopped for core in CORES)
