"""RequestOutput.metrics (vLLM's RequestMetrics), the engine's stats and LLM.get_metrics().

Every output carries its request's timings; the stats histograms are fed from those very time
stamps (one source of truth), and ``disable_log_stats=False`` makes ``LLMEngine`` / ``LLM`` log
vLLM's periodic line and answer ``get_metrics()`` with vLLM's reader objects.
"""

from __future__ import annotations

import logging
import time

import pytest

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.metrics_reader import Counter, Gauge, Histogram
from pagedllm.sampling_params import RequestOutputKind
from tests.helpers import make_tiny_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def engine(folder):
    return LLMEngine.from_engine_args(EngineArgs(model=folder, dtype="float32", max_model_len=256, max_num_seqs=2,
                                                 disable_log_stats=False))


def drain(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
        engine.engine_core.scheduler.check_integrity()
    assert engine.engine_core.scheduler.block_pool.get_usage() == 0.0
    return outputs


def sample_value(engine: LLMEngine, name: str) -> float:
    registry = engine.stat_logger.registry
    value = registry.get_sample_value(name, {"model_name": engine.model_config.served_model_name})
    return 0.0 if value is None else value


def test_every_output_carries_its_request_metrics(engine):
    arrival = time.time() - 0.5  # given by the caller: kept as is
    prompt = {"prompt_token_ids": list(range(10, 40))}
    engine.add_request("a", prompt, SamplingParams(max_tokens=6, ignore_eos=True), arrival_time=arrival)
    engine.add_request("b", prompt, SamplingParams(max_tokens=4, n=2, ignore_eos=True))
    engine.add_request("c", prompt, SamplingParams(max_tokens=3, ignore_eos=True))  # waits: max_num_seqs=2
    outputs = drain(engine)
    assert all(o.metrics is not None for o in outputs)
    for o in outputs:
        m = o.metrics
        if not o.finished:  # streamed (CUMULATIVE) outputs: not finished yet
            assert m.finished_time is None
            continue
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
        assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)
    final = {o.request_id: o.metrics for o in outputs if o.finished}
    assert final["a"].arrival_time == arrival
    assert final["a"].time_in_queue >= 0.5
    assert final["c"].first_scheduled_time >= min(final["a"].finished_time, final["b"].finished_time)


def test_a_request_aborted_while_waiting_has_no_schedule_times(engine):
    engine.add_request("w", "Hello there", SamplingParams(max_tokens=2))
    engine.abort_request("w")
    (out,) = drain(engine)
    m = out.metrics
    assert out.outputs[0].finish_reason == "abort"
    assert m.first_scheduled_time is None and m.time_in_queue is None and m.first_token_time is None
    assert m.finished_time >= m.arrival_time


def test_streamed_outputs_report_token_times(engine):
    engine.add_request("s", "Once upon a time", SamplingParams(max_tokens=5, ignore_eos=True,
                                                              output_kind=RequestOutputKind.DELTA))
    outs = [o for o in drain(engine) if o.request_id == "s"]
    firsts = {o.metrics.first_token_time for o in outs}
    assert len(firsts) == 1  # the first token's time never changes
    lasts = [o.metrics.last_token_time for o in outs]
    assert lasts == sorted(lasts) and len(set(lasts)) == len(outs)  # one new stamp per step


def test_histograms_are_fed_by_the_request_metrics(engine):
    """The engine's histograms observe exactly the RequestMetrics' differences (one source of truth)."""
    names = ("pagedllm:e2e_request_latency_seconds_sum", "pagedllm:request_queue_time_seconds_sum",
             "pagedllm:time_to_first_token_seconds_sum", "pagedllm:request_prefill_time_seconds_sum",
             "pagedllm:e2e_request_latency_seconds_count")
    before = {n: sample_value(engine, n) for n in names}
    for i in range(3):
        engine.add_request(f"h{i}", {"prompt_token_ids": list(range(5 + i, 30))},
                           SamplingParams(max_tokens=4, ignore_eos=True))
    finals = [o.metrics for o in drain(engine) if o.finished]
    delta = {n: sample_value(engine, n) - before[n] for n in names}
    assert delta["pagedllm:e2e_request_latency_seconds_count"] == 3
    assert delta["pagedllm:e2e_request_latency_seconds_sum"] == pytest.approx(
        sum(m.finished_time - m.arrival_time for m in finals), abs=1e-6)
    assert delta["pagedllm:request_queue_time_seconds_sum"] == pytest.approx(
        sum(m.time_in_queue for m in finals), abs=1e-6)
    assert delta["pagedllm:time_to_first_token_seconds_sum"] == pytest.approx(
        sum(m.first_token_time - m.arrival_time for m in finals), abs=1e-6)
    assert delta["pagedllm:request_prefill_time_seconds_sum"] == pytest.approx(
        sum(m.first_token_time - m.first_scheduled_time for m in finals), abs=1e-6)


def test_engine_logs_the_periodic_stats_line(engine, caplog):
    engine.stat_logger.log_interval_s = 0.0  # every step (the default interval is 10 s)
    try:
        with caplog.at_level(logging.INFO, logger="pagedllm"):
            engine.add_request("l", "Hello", SamplingParams(max_tokens=3, ignore_eos=True))
            drain(engine)
    finally:
        engine.stat_logger.log_interval_s = 10.0
    lines = [r.getMessage() for r in caplog.records if "Avg prompt throughput" in r.getMessage()]
    assert lines and all("Running:" in x and "KV cache usage:" in x and "Prefix cache hit rate:" in x for x in lines)


def test_llm_get_metrics_returns_vllm_shaped_objects(folder, caplog):
    llm = LLM(folder, dtype="float32", max_model_len=256, disable_log_stats=False)
    outs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    metrics = llm.get_metrics()
    by_name = {m.name: m for m in metrics}
    assert all(m.name.startswith("pagedllm:") for m in metrics)
    generated = by_name["pagedllm:generation_tokens"]
    assert isinstance(generated, Counter) and generated.value == sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated.labels == {"model_name": llm.llm_engine.model_config.served_model_name}
    assert isinstance(by_name["pagedllm:num_requests_running"], Gauge)
    assert by_name["pagedllm:num_requests_running"].value == 0
    e2e = by_name["pagedllm:e2e_request_latency_seconds"]
    assert isinstance(e2e, Histogram) and e2e.count == 2 == e2e.buckets["+Inf"] and e2e.sum > 0
    success = [m for m in metrics if m.name == "pagedllm:request_success"]
    assert [(m.labels["finished_reason"], m.value) for m in success] == [("length", 2)]


def test_llm_without_stats_refuses_get_metrics(folder):
    llm = LLM(folder, dtype="float32", max_model_len=256)  # vLLM's default for LLM: stats off
    assert llm.llm_engine.stat_logger is None
    with pytest.raises(RuntimeError, match="disable_log_stats=False"):
        llm.get_metrics()
