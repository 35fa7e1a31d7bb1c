"""After start-up the engine moves every object built so far out of the garbage collector's sight
(``gc.freeze``), so full collections while serving do not scan them (a 0.1-0.2 s step-loop stall)."""

import gc

from pagedllm import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from tests.helpers import make_tiny_model


def test_start_up_objects_are_frozen(tmp_path):
    gc.unfreeze()
    engine = LLMEngine.from_engine_args(EngineArgs(model=make_tiny_model("llama", tmp_path), dtype="float32"))
    try:
        assert gc.get_freeze_count() > 10_000
    finally:
        del engine  # its finalizer hands the frozen objects back to the collector


def test_a_dropped_engine_frees_its_model_kv_cache_and_scheduler(tmp_path):
    """Nothing the engine built outlives it: the model and the KV cache go with the last reference
    (no runner <-> step-handle cycle), and the scheduler's cycles at the next collection (the
    engine hands its frozen objects back to the collector)."""
    import weakref

    from pagedllm import SamplingParams

    gc.unfreeze()
    engine = LLMEngine.from_engine_args(EngineArgs(model=make_tiny_model("llama", tmp_path), dtype="float32",
                                                   skip_tokenizer_init=True))
    engine.add_request("r", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    core = engine.engine_core
    held = {"runner": core.runner, "model": core.runner.model, "kv cache": core.runner.model.attention_layers[0].kv_cache,
            "scheduler": core.scheduler, "block pool": core.scheduler.kv_cache_manager.block_pool}
    refs = {name: weakref.ref(obj) for name, obj in held.items()}
    del held, core, engine
    assert [name for name in ("runner", "model", "kv cache") if refs[name]() is not None] == []
    gc.collect()
    assert [name for name, ref in refs.items() if ref() is not None] == []
    assert gc.get_freeze_count() == 0
