"""AsyncLLMEngine's threading and delivery rules, on a scripted stand-in for LLMEngine (no model).

The stand-in produces one token per request per step and records which thread touched it, so the
tests can check: validation errors surface from generate() unchanged, nothing is queued for a
refused request, an abort (explicit, break, or cancellation) takes effect before the next step,
DELTA outputs merge for a slow consumer, a failing step fails only the requests in flight, and
shutdown ends every live stream. Real-model coverage is in test_openai_server.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.engine.engine_loop import StepReport
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.timeout(60)


class FakeEngine:
    """One token (id = step number) per live request per step; DELTA/CUMULATIVE/FINAL_ONLY honoured."""

    def __init__(self, step_delay: float = 0.005) -> None:
        self.live: dict[str, dict] = {}
        self.pending_abort: list[RequestOutput] = []
        self.steps = 0
        self.step_delay = step_delay
        self.threads: set[str] = set()
        self.fail_next_step = False
        self.events: list[tuple] = []
        self.tokenizer = None
        self.step_tokens: dict[str, tuple[int, int]] = {}  # as OutputProcessor.take_step_tokens

    def report_steps(self) -> None:
        pass

    def step_report(self, outputs) -> StepReport:  # as LLMEngine.step_report
        taken, self.step_tokens = self.step_tokens, {}
        return StepReport(outputs, self.get_scheduler_stats(), taken, time.time())

    def _touch(self) -> None:
        self.threads.add(threading.current_thread().name)

    def get_scheduler_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=len(self.live), num_waiting=0, kv_cache_usage=0.1 * len(self.live),
                              prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions_total=0)

    def get_engine_config(self):
        model_config = SimpleNamespace(served_model_name="fake", max_model_len=128, vocab_size=100)
        return SimpleNamespace(model_config=model_config, max_logprobs=20)

    def get_tokenizer(self):
        return None

    def shutdown(self) -> None:
        pass

    def add_request(self, request_id, prompt, params, arrival_time=None, lora_request=None,
                    tokenization_kwargs=None, trace_headers=None, priority=0) -> None:
        self._touch()
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("prompt must not be empty")
        if request_id in self.live:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        self.live[request_id] = {"params": params, "tokens": [], "sent": 0, "prompt": prompt,
                                 "arrival": time.time() if arrival_time is None else arrival_time}
        self.events.append(("add", request_id, self.steps))

    def abort_request(self, ids) -> None:
        self._touch()
        ids = [ids] if isinstance(ids, str) else list(ids)
        for rid in ids:
            st = self.live.pop(rid, None)
            if st is not None:
                self.events.append(("abort", rid, self.steps))
                self.pending_abort.append(self._output(rid, st, "abort"))

    def has_unfinished_requests(self) -> bool:
        return bool(self.live or self.pending_abort)

    def get_num_unfinished_requests(self) -> int:
        return len(self.live)

    def step(self) -> list[RequestOutput]:
        self._touch()
        self.steps += 1
        time.sleep(self.step_delay)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        outs, self.pending_abort = self.pending_abort, []
        for rid, st in list(self.live.items()):
            st["tokens"].append(self.steps)
            self.step_tokens[rid] = (self.step_tokens.get(rid, (0, 2))[0] + 1, 2)
            done = len(st["tokens"]) >= st["params"].max_tokens
            if done:
                del self.live[rid]
            out = self._output(rid, st, "length" if done else None)
            if out is not None:
                outs.append(out)
        return outs

    def _output(self, rid, st, finish) -> RequestOutput | None:
        kind = st["params"].output_kind
        if kind == RequestOutputKind.FINAL_ONLY and finish is None:
            return None
        toks = st["tokens"][st["sent"]:] if kind == RequestOutputKind.DELTA else list(st["tokens"])
        st["sent"] = len(st["tokens"])
        comp = CompletionOutput(0, "".join(f"<{t}>" for t in toks), toks, finish_reason=finish)
        metrics = RequestMetrics(st["arrival"], finished_time=time.time() if finish else None)
        return RequestOutput(rid, st["prompt"], [1, 2], None, [comp], finished=finish is not None, metrics=metrics)


@pytest.fixture
def fake():
    engine = FakeEngine()
    aengine = AsyncLLMEngine(engine, log_stats=False, idle_poll_s=0.05)
    yield engine, aengine
    aengine.shutdown(timeout_s=5)


def _params(max_tokens: int, kind=RequestOutputKind.DELTA) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, output_kind=kind)


async def _collect(aengine, prompt, params, rid):
    return [o async for o in aengine.generate(prompt, params, rid)]


def test_generate_streams_every_step_and_ends_finished(fake):
    engine, aengine = fake

    async def main():
        outs = await _collect(aengine, "hi", _params(5), "r1")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 5
    assert engine.threads == {"pagedllm-engine"}  # only the loop thread ever touched the engine


def test_validation_error_surfaces_unchanged_and_queues_nothing(fake):
    engine, aengine = fake

    async def main():
        with pytest.raises(ValueError, match="prompt must not be empty"):
            async for _ in aengine.generate("", _params(3), "bad"):
                pass
        # the same id is free to use afterwards: nothing was queued for it
        return await _collect(aengine, "ok", _params(2), "bad")

    outs = asyncio.run(main())
    assert outs[-1].finished
    assert [e for e in engine.events if e[0] == "add"] == [("add", "bad", engine.events[0][2])]


def test_duplicate_live_id_is_refused_without_touching_the_first(fake):
    engine, aengine = fake

    async def main():
        first = asyncio.ensure_future(_collect(aengine, "a", _params(20), "dup"))
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="already in use"):
            await _collect(aengine, "b", _params(2), "dup")
        return await first

    outs = asyncio.run(main())
    assert outs[-1].outputs[0].finish_reason == "length"  # the first request was not aborted
    assert not [e for e in engine.events if e[0] == "abort"]


def test_abort_takes_effect_before_the_next_step(fake):
    engine, aengine = fake

    async def main():
        outs = []
        async for out in aengine.generate("x", _params(1000), "long"):
            outs.append(out)
            if len(outs) == 3:
                await aengine.abort("long")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    add_step = next(e[2] for e in engine.events if e[0] == "add")
    abort_step = next(e[2] for e in engine.events if e[0] == "abort")
    assert abort_step - add_step < 10
    assert not engine.live


def test_leaving_the_loop_or_cancelling_aborts(fake):
    engine, aengine = fake

    async def main():
        async for _ in aengine.generate("x", _params(1000), "brk"):
            break
        task = asyncio.ensure_future(_collect(aengine, "y", _params(1000), "cancel"))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 5
        while engine.live and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert not engine.live
    assert {e[1] for e in engine.events if e[0] == "abort"} == {"brk", "cancel"}


def test_delta_outputs_merge_for_a_slow_consumer(fake):
    engine, aengine = fake

    async def main():
        outs = []
        async for out in aengine.generate("x", _params(30), "slow"):
            outs.append(out)
            await asyncio.sleep(0.05)  # ~10 steps per read
        return outs

    outs = asyncio.run(main())
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    assert len(tokens) == 30 and tokens == sorted(tokens)
    assert "".join(o.outputs[0].text for o in outs) == "".join(f"<{t}>" for t in tokens)
    assert len(outs) < 30  # merged, not queued one by one


def test_cumulative_and_final_only_kinds(fake):
    _, aengine = fake

    async def main():
        cum = await _collect(aengine, "x", _params(4, RequestOutputKind.CUMULATIVE), "cum")
        fin = await _collect(aengine, "x", _params(4, RequestOutputKind.FINAL_ONLY), "fin")
        return cum, fin

    cum, fin = asyncio.run(main())
    assert len(cum[-1].outputs[0].token_ids) == 4
    assert len(fin) == 1 and len(fin[0].outputs[0].token_ids) == 4


def test_many_concurrent_requests_all_complete(fake):
    _, aengine = fake

    async def main():
        return await asyncio.gather(*[_collect(aengine, "p", _params(3 + i % 5), f"c{i}") for i in range(64)])

    results = asyncio.run(main())
    for i, outs in enumerate(results):
        assert outs[-1].finished
        assert sum(len(o.outputs[0].token_ids) for o in outs) == 3 + i % 5


def test_failed_step_fails_requests_in_flight_but_engine_keeps_serving(fake):
    engine, aengine = fake

    async def main():
        task = asyncio.ensure_future(_collect(aengine, "x", _params(1000), "victim"))
        await asyncio.sleep(0.05)
        engine.fail_next_step = True
        with pytest.raises(RuntimeError, match="boom"):
            await task
        return await _collect(aengine, "y", _params(2), "after")

    outs = asyncio.run(main())
    assert outs[-1].finished and aengine.is_running


def test_shutdown_ends_live_streams_with_abort():
    engine = FakeEngine()
    aengine = AsyncLLMEngine(engine, log_stats=False, idle_poll_s=0.05)

    async def main():
        outs = []
        async for out in aengine.generate("x", _params(100000), "live"):
            outs.append(out)
            if len(outs) == 2:
                await asyncio.get_running_loop().run_in_executor(None, aengine.shutdown)
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert not aengine.is_running

    async def after():
        with pytest.raises(EngineDeadError):
            await _collect(aengine, "x", _params(2), "late")

    asyncio.run(after())


def test_metrics_count_tokens_and_finishes(fake):
    from prometheus_client.parser import text_string_to_metric_families

    engine, aengine = fake

    async def main():
        await asyncio.gather(*[_collect(aengine, "p", _params(4), f"m{i}") for i in range(3)])

    asyncio.run(main())
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(aengine.metrics.render().decode()) for s in fam.samples}
    assert samples[("pagedllm:generation_tokens_total", (("model_name", "fake"),))] == 12
    assert samples[("pagedllm:request_success_total", (("finished_reason", "length"), ("model_name", "fake")))] == 3
    assert samples[("pagedllm:time_to_first_token_seconds_count", (("model_name", "fake"),))] == 3
    assert samples[("pagedllm:num_requests_running", (("model_name", "fake"),))] == 0


def test_metrics_count_final_only_tokens_as_they_are_generated(fake):
    """A non-streaming (FINAL_ONLY) request gets one RequestOutput, at the end; the metrics still see
    its tokens step by step: generation tokens before it finishes, TTFT at its first token and one
    inter-token latency sample per later token."""
    from prometheus_client.parser import text_string_to_metric_families

    engine, aengine = fake

    def sample(name: str) -> float:
        for fam in text_string_to_metric_families(aengine.metrics.render().decode()):
            for s in fam.samples:
                if s.name == name:
                    return s.value
        raise KeyError(name)

    async def main():
        task = asyncio.ensure_future(_collect(aengine, "p", _params(40, RequestOutputKind.FINAL_ONLY), "fin"))
        while engine.steps < 10:
            await asyncio.sleep(0.01)
        mid = sample("pagedllm:generation_tokens_total")
        await task
        return mid

    mid = asyncio.run(main())
    assert 0 < mid < 40  # counted while the request was still running
    assert sample("pagedllm:generation_tokens_total") == 40
    assert sample("pagedllm:time_to_first_token_seconds_count") == 1
    assert sample("pagedllm:inter_token_latency_seconds_count") == 39
    assert sample("pagedllm:time_to_first_token_seconds_sum") < sample("pagedllm:e2e_request_latency_seconds_sum")


def test_async_with_shuts_the_engine_down_on_exit():
    engine = FakeEngine()

    async def main():
        async with AsyncLLMEngine(engine, log_stats=False, idle_poll_s=0.05) as aengine:
            outs = await _collect(aengine, "hi", _params(3), "r1")
        return aengine, outs

    aengine, outs = asyncio.run(main())
    assert outs[-1].finished
    with pytest.raises(EngineDeadError):  # shut down: new requests are refused
        asyncio.run(_collect(aengine, "hi", _params(1), "r2"))
