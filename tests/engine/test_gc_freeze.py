"""After start-up the engine moves every object built so far out of the garbage collector's sight
(``gc.freeze``), so full collections while serving do not scan them (a 0.1-0.2 s step-loop stall)."""

import gc

from pagedllm import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from tests.helpers import make_tiny_model


def test_start_up_objects_are_frozen(tmp_path):
    gc.unfreeze()
    LLMEngine.from_engine_args(EngineArgs(model=make_tiny_model("llama", tmp_path), dtype="float32"))
    try:
        assert gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()
