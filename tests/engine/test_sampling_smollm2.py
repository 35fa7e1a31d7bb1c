"""Sampling fields on the embedded SmolLM2 (real weights, real text) against transformers: logprobs
and prompt logprobs within 1e-4, a repetition-penalised greedy run, and a stop string in real
output. One engine and one transformers model for the whole module (slow: a few per test)."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.helpers import has_default_model
from tests.sample.reference import ref_penalties

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not has_default_model(), reason="embedded SmolLM2 not installed")]

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM

    from pagedllm.loader import default_model_path

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    return LLM(dtype="float32", max_model_len=256, max_num_seqs=8), hf


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def test_smollm2_logprobs_and_prompt_logprobs(smollm2):
    llm, hf = smollm2
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    raw = _hf_logprobs(hf, ids)
    n = len(out.prompt_token_ids)
    assert len(out.prompt_logprobs) == n and out.prompt_logprobs[0] is None
    for j in range(1, n):
        for tid, lp in out.prompt_logprobs[j].items():
            assert abs(lp.logprob - raw[j - 1, tid].item()) < 1e-4, (j, tid)
    for j, d in enumerate(out.outputs[0].logprobs):
        assert set(raw[n + j - 1].topk(3).indices.tolist()) <= set(d)
        for tid, lp in d.items():
            assert abs(lp.logprob - raw[n + j - 1, tid].item()) < 1e-4, (j, tid)
    assert out.outputs[0].text.startswith(" Paris")


def test_smollm2_repetition_penalty_matches_transformers(smollm2):
    llm, hf = smollm2
    prompt = llm.get_tokenizer().encode("List the days: Monday, Tuesday, Wednesday, Monday, Tuesday,")
    ours = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                                     repetition_penalty=1.5), use_tqdm=False)
    out: list[int] = []
    for _ in range(8):
        with torch.inference_mode():
            raw = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        out.append(int(ref_penalties(raw, prompt, out, repetition=1.5).argmax()))
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)
    assert ours[0].outputs[0].token_ids == out
    assert plain[0].outputs[0].token_ids != out, "the penalty should change this continuation"


def test_smollm2_stop_string_in_real_text(smollm2):
    llm, _ = smollm2
    full = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    word = full.text.split()[1] if len(full.text.split()) > 1 else full.text.split()[0]
    cut = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, stop=[word]), use_tqdm=False)[0].outputs[0]
    assert cut.text == full.text[: full.text.index(word)] and cut.finish_reason == "stop" and cut.stop_reason == word
