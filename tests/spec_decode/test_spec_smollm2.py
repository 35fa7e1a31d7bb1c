"""N-gram speculation on the embedded SmolLM2 (real weights, CPU): a prompt that asks to repeat a
passage gives the same greedy text with and without speculation, with drafts accepted."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.helpers import has_default_model

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not has_default_model(), reason="embedded SmolLM2 not installed")]

PASSAGE = ("The quick brown fox jumps over the lazy dog near the river bank, and the old miller "
           "watches the water turn the wheel while the children count the ducks.")
PROMPT = f"Repeat the text exactly.\n\nText: {PASSAGE}\n\nRepeated text: {PASSAGE}\n\nRepeated text:"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def test_ngram_greedy_text_equals_plain_and_drafts_are_accepted():
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs, stats = {}, None
    for name, spec in (("plain", None), ("ngram", SPEC)):
        llm = LLM(dtype="float32", max_model_len=256, max_num_seqs=4, speculative_config=spec)
        outs[name] = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
        if spec is not None:
            stats = llm.llm_engine.engine_core.scheduler.stats().spec_decoding
        llm.llm_engine.shutdown()
    assert outs["ngram"] == outs["plain"]
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    # Copying the passage: most drafts are right, so a step gives well over one token.
    assert stats.mean_acceptance_length > 2.0
