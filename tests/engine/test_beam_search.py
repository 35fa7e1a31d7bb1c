"""LLM.beam_search against a brute-force beam search over transformers' logits (no KV cache).

The tiny model's EOS row of the LM head is set just below a token the model likes, so EOS shows
up among the candidates and finished beams compete with live ones under the length penalty.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, BeamSearchParams
from tests.helpers import make_tiny_model

EOS = 2


@pytest.fixture(scope="module")
def beam_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"))  # untied LM head
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [[random.Random(i).randrange(3, 49152) for _ in range(n)] for i, n in ((0, 40), (1, 21), (2, 7))]
    with torch.no_grad():
        liked = int(hf(torch.tensor([prompts[0]])).logits[0, -1].argmax())
        hf.lm_head.weight[EOS] = 0.97 * hf.lm_head.weight[liked]
    hf.save_pretrained(folder)
    return folder, hf, prompts


def brute_force_beam_search(hf, prompt, beam_width, max_tokens, length_penalty, ignore_eos):
    """Every step: expand each beam by its 2*beam_width most likely tokens (full forward, float32),
    set EOS-ended ones aside, keep the best beam_width by length-penalised score."""
    def score(seq):
        tokens, cum = seq
        n = len(tokens) - (1 if tokens[-1] == EOS else 0)
        return cum / n**length_penalty

    live, finished = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in live:
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1].float(), -1)
            values, ids = lp.topk(2 * beam_width)
            for v, t in zip(values.tolist(), ids.tolist()):
                (finished if t == EOS and not ignore_eos else candidates).append((tokens + [t], cum + v))
        live = sorted(candidates, key=score, reverse=True)[:beam_width]
    return sorted(finished + live, key=score, reverse=True)[:beam_width]


@pytest.mark.parametrize("beam_width, max_tokens, length_penalty, ignore_eos, include_stop", [
    (3, 5, 1.0, False, True), (2, 4, 0.0, True, False), (4, 3, 2.0, False, False),
])
def test_beam_search_matches_brute_force(beam_model, beam_width, max_tokens, length_penalty, ignore_eos,
                                         include_stop):
    """Same beams, scores and order as the brute force; a beam ended by EOS keeps the EOS in its
    tokens and text only with include_stop_str_in_output (as vLLM)."""
    folder, hf, prompts = beam_model
    llm = LLM(folder, dtype="float32")
    params = BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, length_penalty=length_penalty,
                              ignore_eos=ignore_eos, include_stop_str_in_output=include_stop)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    tok = llm.get_tokenizer()
    saw_eos = False
    for prompt, out in zip(prompts, outputs):
        ref = brute_force_beam_search(hf, prompt, beam_width, max_tokens, length_penalty, ignore_eos)
        ended = [t[-1] == EOS and not ignore_eos for t, _ in ref]
        assert [s.tokens for s in out.sequences] == [
            t[:-1] if end and not include_stop else t for (t, _), end in zip(ref, ended)]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx([c for _, c in ref], abs=1e-4)
        for s, end in zip(out.sequences, ended):
            assert s.text == tok.decode(s.tokens) and s.tokens[: len(prompt)] == prompt
            assert (s.finish_reason, s.stop_reason) == (("stop", EOS) if end else ("length", None))
            assert (s.tokens[-1] == EOS) == (end and include_stop) or ignore_eos
            saw_eos |= end
    assert saw_eos or ignore_eos, "the EOS row was meant to make some beam finish early"
    assert llm.llm_engine.engine_core.scheduler.stats().prefix_cache_hits > 0, "beams share prefix blocks"


def test_beam_search_params_validation():
    with pytest.raises(ValueError, match="^beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=3)
    with pytest.raises(ValueError, match="^max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="^temperature"):
        BeamSearchParams(beam_width=2, max_tokens=3, temperature=-1.0)
    with pytest.raises(ValueError, match="^length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=3, length_penalty="long")
