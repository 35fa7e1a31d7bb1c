"""Speculative decoding's metrics: vLLM's spec_decode_* counters in LLM.get_metrics(), the
/metrics exposition and the periodic log line's mean acceptance length."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.scheduler import SpecDecodingStats
from pagedllm.engine.metrics_reader import Counter, Vector
from tests.helpers import make_tiny_model


def test_spec_decoding_stats_count_drafts_and_accepted_per_position():
    stats = SpecDecodingStats()
    stats.observe(3, 3)
    stats.observe(3, 1)
    stats.observe(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 4)
    assert stats.num_accepted_tokens_per_pos == [2, 1, 1]
    assert stats.mean_acceptance_length == pytest.approx(1 + 4 / 3)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    target = make_tiny_model("llama", tmp_path_factory.mktemp("t"))
    return LLM(target, disable_log_stats=False, max_model_len=128, max_num_seqs=4,
               speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 3})


def test_metrics_count_every_draft_of_a_draft_equal_to_the_target(llm):
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}],
                 SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics["pagedllm:spec_decode_num_drafts"]
    assert isinstance(drafts, Counter) and drafts.value > 0
    assert metrics["pagedllm:spec_decode_num_draft_tokens"].value == 3 * drafts.value
    assert metrics["pagedllm:spec_decode_num_accepted_tokens"].value == 3 * drafts.value
    per_pos = metrics["pagedllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and per_pos.values == [drafts.value] * 3
    stat_logger = llm.llm_engine.stat_logger
    text = stat_logger.render().decode()
    assert 'pagedllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=' in text
    assert f'position="2"}} {float(drafts.value)}' in text
    stat_logger.log_interval_s = 0.0
    stat_logger._interval.num_drafts, stat_logger._interval.num_draft_tokens = 4, 12
    stat_logger._interval.num_accepted_tokens, stat_logger._interval.generation_tokens = 6, 10
    assert "Spec decode mean acceptance length: 2.50, draft acceptance rate: 50.0%" in stat_logger.maybe_log()


def test_no_spec_decode_series_without_drafts():
    from pagedllm.core.scheduler import SchedulerStats
    from pagedllm.engine.metrics import EngineMetrics

    metrics = EngineMetrics("m")
    metrics._record_scheduler(SchedulerStats(1, 0, 0.1, 0, 0, 0))
    assert b"spec_decode" not in metrics.render()
