"""A GGUF file under tensor parallelism (two gloo CPU worker processes, each reading only its slices):
the greedy ids equal the single-process engine's on a tiny random Llama, with the blocks kept packed
(Q4_1, the LM head tied to the embedding as in SmolLM2's file) and dequantized at load (Q8_0, an
untied head, ``load_format="gguf_dequantized"``)."""

from __future__ import annotations

import pytest

from pagedllm import EngineArgs, LLMEngine, SamplingParams
from tests.helpers import default_tokenizer
from tests.loader.tiny_gguf import write_tiny_gguf

pytest.importorskip("gguf")
pytestmark = pytest.mark.timeout(300)

PROMPTS = [[1000 + 7 * i + j for j in range(4 + 5 * i)] for i in range(4)]
ENGINE = dict(max_num_seqs=4, max_model_len=128, seed=0)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    default_tokenizer().save_pretrained(folder)
    return str(folder)


def greedy_ids(path: str, tokenizer: str, tensor_parallel_size: int, load_format: str) -> list[list[int]]:
    engine = LLMEngine.from_engine_args(EngineArgs(path, tokenizer=tokenizer, load_format=load_format,
                                                   tensor_parallel_size=tensor_parallel_size, **ENGINE))
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
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


@pytest.mark.parametrize(("qtype", "load_format"), [("Q4_1", "auto"), ("Q8_0", "gguf_dequantized")])
def test_tp2_on_a_gguf_file_gives_the_greedy_ids_of_one_rank(qtype, load_format, tokenizer_folder, tmp_path,
                                                             monkeypatch):
    # A fresh cache: the dequantized path reads the GGUF file itself, not a float copy of an earlier run.
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype, tied=load_format == "auto")
    sharded = greedy_ids(path, tokenizer_folder, 2, load_format)
    assert sharded == greedy_ids(path, tokenizer_folder, 1, load_format)
