"""The engine API of pooling requests (the seed's ``add_request(..., params=PoolingParams())``):
outputs, block freeing, aborts, refusals naming the field, and the runner / task arguments."""

from __future__ import annotations

import pytest
import torch

from pagedllm import EngineArgs, PoolingParams, PoolingRequestOutput, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from tests.embedding_helpers import make_tiny_bert, make_tiny_qwen3

pytestmark = pytest.mark.timeout(300)
ENGINE = dict(kv_cache_memory=16 * 2**20, max_num_seqs=8, disable_log_stats=True)


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    return make_tiny_bert(tmp_path_factory.mktemp("pooling-engine"), "mean", normalize=True)


@pytest.fixture(scope="module")
def engine(bert_folder):
    engine = LLMEngine.from_engine_args(EngineArgs(model=bert_folder, **ENGINE))
    yield engine
    engine.shutdown()


def _run(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def _free_blocks(engine: LLMEngine) -> int:
    return engine.engine_core.scheduler.block_pool.get_num_free_blocks()


def test_add_request_with_pooling_params_returns_pooling_outputs_and_frees_blocks_at_once(engine):
    scheduler = engine.engine_core.scheduler
    free_before = _free_blocks(engine)
    engine.add_request("a", "hello world", params=PoolingParams())
    engine.add_request("b", {"prompt_token_ids": [101, 7592, 2088, 102]}, PoolingParams(normalize=False))
    outputs = engine.step()  # both prompts fit one step: pooled, finished and freed by it
    assert sorted(o.request_id for o in outputs) == ["a", "b"]
    assert not scheduler.requests and _free_blocks(engine) == free_before
    scheduler.check_integrity()
    by_id = {o.request_id: o for o in outputs}
    a, b = by_id["a"], by_id["b"]
    assert isinstance(a, PoolingRequestOutput) and a.finished and a.prompt_token_ids[0] == 101
    assert a.outputs.data.shape == (64,) and a.outputs.data.dtype == torch.float32
    torch.testing.assert_close(a.outputs.data.norm(), torch.tensor(1.0))
    assert b.prompt_token_ids == [101, 7592, 2088, 102]
    assert abs(b.outputs.data.norm().item() - 1.0) > 1e-3  # normalize=False honoured
    assert _run(engine) == []  # one more step tells the runner; nothing else comes out


def test_abort_of_a_pooling_request_ends_it_without_a_vector_and_frees_its_blocks(engine):
    free_before = _free_blocks(engine)
    engine.add_request("gone", "to be aborted", PoolingParams())
    engine.abort_request("gone")
    outputs = _run(engine)
    assert [(o.request_id, o.outputs, o.finished) for o in outputs] == [("gone", None, True)]
    assert _free_blocks(engine) == free_before
    engine.engine_core.scheduler.check_integrity()


@pytest.mark.parametrize("params,error,field", [
    (SamplingParams(max_tokens=2), TypeError, "params"),
    (PoolingParams(dimensions=16), ValueError, "dimensions"),  # tiny BERT is no Matryoshka model
    ("not params", TypeError, "params"),
])
def test_refused_params_name_the_field_and_leave_nothing_behind(engine, params, error, field):
    with pytest.raises(error, match=rf"^{field}"):
        engine.add_request("bad", "hello", params)
    assert not engine.has_unfinished_requests()
    engine.add_request("bad", "hello", PoolingParams())  # the id was not taken
    assert [o.request_id for o in _run(engine)] == ["bad"]


@pytest.mark.parametrize("prompt,field", [("", "prompt"), ({"prompt_token_ids": [101, 30522]}, "prompt_token_ids"),
                                          ({"prompt_token_ids": [-1, 101]}, "prompt_token_ids"),
                                          ({"prompt_token_ids": [101] * 129}, "prompt")])
def test_bad_prompts_are_refused_naming_the_field(engine, prompt, field):
    with pytest.raises(ValueError, match=rf"^{field}"):
        engine.add_request("bad-prompt", prompt, PoolingParams())
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("ids", [[101, True, 102], [101, 2.0, 102], [101, "7", 102]])
def test_token_ids_that_are_not_ints_are_refused(engine, ids):
    with pytest.raises(TypeError, match="^prompt_token_ids"):
        engine.add_request("bad-ids", {"prompt_token_ids": ids}, PoolingParams())
    with pytest.raises(TypeError, match="^prompt"):
        engine.add_request("bad-ids", ids, PoolingParams())
    assert not engine.has_unfinished_requests()


def test_int_subclass_token_ids_are_accepted(engine):
    class TokenId(int):
        pass

    engine.add_request("subclass", {"prompt_token_ids": [TokenId(101), TokenId(7592), TokenId(102)]}, PoolingParams())
    engine.add_request("plain", {"prompt_token_ids": [101, 7592, 102]}, PoolingParams())
    by_id = {o.request_id: o.outputs.data for o in _run(engine)}
    torch.testing.assert_close(by_id["subclass"], by_id["plain"])


def test_pooling_params_clone_is_an_independent_equal_copy():
    params = PoolingParams(dimensions=8)
    twin = params.clone()
    assert twin == params and twin is not params
    twin.normalize = False
    assert params.normalize is None


def test_a_prompt_may_fill_max_model_len(engine):
    engine.add_request("full", {"prompt_token_ids": [101] * 128}, PoolingParams())  # max_position_embeddings
    assert _run(engine)[0].outputs.data.shape == (64,)


def test_pooling_params_validate_their_fields():
    with pytest.raises(ValueError, match="^dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(TypeError, match="^dimensions"):
        PoolingParams(dimensions="8")
    with pytest.raises(TypeError, match="^normalize"):
        PoolingParams(normalize="yes")


def test_runner_and_task_arguments(bert_folder, tmp_path):
    with pytest.raises(ValueError, match="^runner must be one of"):
        EngineArgs(runner="embed")
    with pytest.raises(ValueError, match="^task must be one of"):
        EngineArgs(task="classify")
    with pytest.raises(ValueError, match="^task='embed' contradicts runner='generate'"):
        EngineArgs(task="embed", runner="generate")
    assert EngineArgs(task="embed").runner == "pooling"
    with pytest.raises(ValueError, match="^runner: BertModel is an encoder-only model"):
        LLMEngine.from_engine_args(EngineArgs(model=bert_folder, runner="generate", **ENGINE))


def test_a_generation_engine_refuses_pooling_params(tmp_path):
    from tests.helpers import make_tiny_model

    folder = make_tiny_model("qwen3", tmp_path / "qwen3")
    engine = LLMEngine.from_engine_args(EngineArgs(model=folder, **ENGINE))
    try:
        assert engine.model_config.runner == "generate"
        with pytest.raises(TypeError, match="^params must be SamplingParams"):
            engine.add_request("x", "hello", PoolingParams())
    finally:
        engine.shutdown()
    pooled = LLMEngine.from_engine_args(EngineArgs(model=folder, task="embed", **ENGINE))  # a CausalLM as embedder
    try:
        pooled.add_request("x", "hello", PoolingParams())
        assert _run(pooled)[0].outputs.data.shape == (64,)
        assert pooled.model_config.pooler_config.pooling_type == "LAST"  # no modules.json: vLLM's default
    finally:
        pooled.shutdown()


def test_chunked_prompts_of_a_decoder_free_their_blocks(tmp_path):
    folder = make_tiny_qwen3(tmp_path, "mean")
    engine = LLMEngine.from_engine_args(EngineArgs(model=folder, max_num_batched_tokens=8, **ENGINE))
    try:
        free_before = _free_blocks(engine)
        for i in range(5):
            engine.add_request(f"r{i}", {"prompt_token_ids": list(range(10, 30 + 7 * i))}, PoolingParams())
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            engine.engine_core.scheduler.check_integrity()
            steps += 1
        assert steps > 5  # the prompts really were split over steps
        assert _free_blocks(engine) == free_before
        assert not engine.engine_core.runner._partials and not engine.engine_core.runner._params
    finally:
        engine.shutdown()
