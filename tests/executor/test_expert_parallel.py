"""Expert parallel at tensor_parallel_size=2 (gloo, two CPU worker processes) on a tiny random
Qwen3-MoE: greedy ids equal to the single-process engine's with the experts split whole over the
ranks (``enable_expert_parallel``). The model has an odd expert size (33), which only whole experts
can split: the flag reaches the workers. (Sliced experts: tests/layers/test_fused_moe.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedllm import EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from pagedllm.engine.config_builder import create_engine_config  # noqa: E402
from tests.models.moe_tiny import VOCAB, make_tiny_moe  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[(7 * i + 13 * j) % (VOCAB - 3) + 3 for j in range(6 + 5 * i)] for i in range(4)]
ENGINE = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=128, num_gpu_blocks_override=64, seed=0)




def greedy(folder, **kwargs) -> list[list[int]]:
    engine = LLMEngine.from_engine_args(EngineArgs(folder, **ENGINE, **kwargs))
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            engine.engine_core.scheduler.check_integrity()
        return [outputs[str(i)] for i in range(len(PROMPTS))]
    finally:
        engine.shutdown()


def test_tp2_expert_parallel_greedy_ids_equal_one_rank(tmp_path):
    folder = make_tiny_moe("qwen3_moe", tmp_path / "m", moe_intermediate_size=33)
    with pytest.raises(ValueError, match=r"expert intermediate size \(33\)"):  # sliced experts: refused
        create_engine_config(EngineArgs(folder, **ENGINE, tensor_parallel_size=2))
    assert greedy(folder, tensor_parallel_size=2, enable_expert_parallel=True) == greedy(folder)
