"""Structured-output metrics: grammar compile time (histogram), compiled grammars and cache hits
(counters), bitmask CPU time per step (histogram) and jump-forward tokens (counter), in
``LLM.get_metrics()`` and in the server's ``/metrics``, on a tiny Llama with the SmolLM2 tokenizer."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm import LLM, EngineArgs, SamplingParams, StructuredOutputsParams
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.metrics_reader import Counter, Histogram
from pagedllm.entrypoints.openai import api_server
from tests.helpers import make_tiny_model

pytestmark = pytest.mark.timeout(300)

SCHEMA = {"type": "object", "properties": {"customer_full_name": {"type": "string", "maxLength": 6}},
          "required": ["customer_full_name"], "additionalProperties": False}
NAMES = ("pagedllm:structured_output_compile_time_seconds", "pagedllm:structured_output_compiled",
         "pagedllm:structured_output_cache_hits", "pagedllm:structured_output_bitmask_time_seconds",
         "pagedllm:structured_output_jump_forward_tokens")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("metrics_llama"))


def params(**constraint) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=24,
                          structured_outputs=StructuredOutputsParams(disable_any_whitespace=True, **constraint))


def test_llm_get_metrics_has_the_grammar_metrics(folder):
    llm = LLM(folder, dtype="float32", max_model_len=256, disable_log_stats=False,
              structured_outputs_jump_forward=True)
    try:
        # Two grammars compiled (the schema, the regex), two cache hits (the schema again, twice).
        llm.generate(["a", "b", "c", "d"], [params(json=SCHEMA)] * 3 + [params(regex="[a-z]{3}")], use_tqdm=False)
        manager = llm.llm_engine.engine_core.structured_output
        metrics = {m.name: m for m in llm.get_metrics() if m.name in NAMES}
    finally:
        llm.llm_engine.shutdown()
    compile_time = metrics["pagedllm:structured_output_compile_time_seconds"]
    assert isinstance(compile_time, Histogram) and compile_time.count == 2 and compile_time.sum > 0
    assert compile_time.buckets["+Inf"] == 2
    assert isinstance(metrics["pagedllm:structured_output_compiled"], Counter)
    assert metrics["pagedllm:structured_output_compiled"].value == 2
    assert metrics["pagedllm:structured_output_cache_hits"].value == 2
    bitmask = metrics["pagedllm:structured_output_bitmask_time_seconds"]
    assert bitmask.count == manager.num_bitmask_steps > 0
    assert bitmask.sum == pytest.approx(manager.bitmask_time_s)
    # '{"customer_full_name":"' is forced after the first token: jumped, not sampled.
    assert metrics["pagedllm:structured_output_jump_forward_tokens"].value == manager.num_jumped_tokens >= 4


def test_the_server_exports_the_grammar_metrics(folder):
    engine = AsyncLLMEngine(LLMEngine.from_engine_args(EngineArgs(model=folder, dtype="float32", max_model_len=256)),
                            idle_poll_s=0.05)
    app = api_server.build_app(engine, shutdown_engine=False)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)

    async def main():
        for i in range(2):  # the second finds the grammar in the cache
            async for _ in engine.generate("a", params(json=SCHEMA), f"r{i}"):
                pass
        return (await client.get("/metrics")).text

    try:
        text = asyncio.run(main())
    finally:
        engine.shutdown()
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["pagedllm:structured_output_compile_time_seconds_count"] == 1
    assert samples["pagedllm:structured_output_compiled_total"] == 1
    assert samples["pagedllm:structured_output_cache_hits_total"] == 1
    assert samples["pagedllm:structured_output_bitmask_time_seconds_count"] > 0
    assert samples["pagedllm:structured_output_jump_forward_tokens_total"] == 0  # off by default
