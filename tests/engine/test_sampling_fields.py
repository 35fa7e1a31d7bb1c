"""Every SamplingParams field through the whole engine, against transformers on a tiny random model.

References are computed in the test from transformers' logits (tests/sample/reference.py holds
the plain per-row transforms), never from our own output: greedy decoding with penalties / bias /
allowed ids / bad words / min_tokens, logprobs and prompt logprobs (within 1e-4 of log_softmax),
and the support of top-k / top-p / min-p draws. Seeds, n, best_of, stop ids, ignore_eos,
detokenize=False and the delta output kind are checked on the engine's own contract.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedllm import LLM, EngineArgs, RequestOutputKind, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from tests.engine.reference import NEAR_TIE
from tests.helpers import make_tiny_model
from tests.sample.reference import (
    ref_allowed,
    ref_bad_words,
    ref_ban,
    ref_logit_bias,
    ref_penalties,
    ref_probs,
)

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny[0], dtype="float32")


def hf_last_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def hf_all_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of ``ids`` ([len(ids), V])."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def hf_greedy_processed(hf, prompt: list[int], max_tokens: int, process) -> list[int]:
    """Greedy decoding where ``process(logits, prompt, output)`` transforms each step's logits;
    stops at EOS like the engine (EOS is kept)."""
    out: list[int] = []
    for _ in range(max_tokens):
        logits = process(hf_last_logits(hf, prompt + out), prompt, out)
        tok = int(logits.argmax())
        out.append(tok)
        if tok == EOS:
            break
    return out


def assert_greedy_equal(hf, prompt, ours, ref, process, label):
    """Equal, or first differing at a near-tie of the *processed* reference logits."""
    for j, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            logits = process(hf_last_logits(hf, prompt + ref[:j]), prompt, ref[:j])
            top = torch.log_softmax(logits, -1).topk(2).values
            assert float(top[0] - top[1]) < NEAR_TIE, f"{label}: token {j}: {a} vs {b}\nours={ours}\nref ={ref}"
            return
    assert len(ours) == len(ref), f"{label}: {ours} vs {ref}"


def run(llm: LLM, prompt: list[int], **kwargs):
    return llm.generate({"prompt_token_ids": prompt}, SamplingParams(**kwargs), use_tqdm=False)[0]


def make_prompt(seed: int, n: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


# -- logits processors through the engine, greedy ------------------------------------------------

def _processor_cases(plain: list[int], tokenizer):
    """(name, SamplingParams kwargs, reference transform, must change the plain greedy output)."""
    bias = {plain[1]: -5.0, plain[3]: -3.0, 1234: 4.0}
    allowed = sorted(set(plain[::2]) | {10, 11, 12, 40000})
    word = _bannable_word(plain, tokenizer)
    return [
        ("repetition>1", dict(repetition_penalty=1.8),
         lambda x, p, o: ref_penalties(x, p, o, repetition=1.8), False),
        ("repetition<1", dict(repetition_penalty=0.4),
         lambda x, p, o: ref_penalties(x, p, o, repetition=0.4), True),
        ("presence+frequency", dict(presence_penalty=-2.0, frequency_penalty=0.5),
         lambda x, p, o: ref_penalties(x, p, o, presence=-2.0, frequency=0.5), True),
        ("all penalties", dict(repetition_penalty=0.7, presence_penalty=-1.0, frequency_penalty=2.0),
         lambda x, p, o: ref_penalties(x, p, o, -1.0, 2.0, 0.7), True),
        ("logit_bias", dict(logit_bias=bias), lambda x, p, o: ref_logit_bias(x, bias), True),
        ("allowed_token_ids", dict(allowed_token_ids=allowed), lambda x, p, o: ref_allowed(x, allowed), True),
        ("bad_words", dict(bad_words=[word]),
         lambda x, p, o: ref_bad_words(x, _vllm_bad_words(tokenizer, word), o), True),
        ("min_tokens", dict(min_tokens=5, logit_bias={EOS: 8.0}),
         lambda x, p, o: ref_logit_bias(ref_ban(x, [EOS]) if len(o) < 5 else x, {EOS: 8.0}), True),
        ("bias+penalties", dict(logit_bias=bias, repetition_penalty=1.4),
         lambda x, p, o: ref_penalties(ref_logit_bias(x, bias), p, o, repetition=1.4), True),
    ]


def _bannable_word(plain: list[int], tokenizer) -> str:
    """A word whose vLLM bad-word tokenization contains one of the plain greedy tokens alone."""
    for t in plain:
        word = tokenizer.decode([t]).strip()
        if word and [t] in _vllm_bad_words(tokenizer, word):
            return word
    raise AssertionError(f"the fixed prompt's greedy output {plain} has no whole-word token to ban: pick another prompt")


def _vllm_bad_words(tokenizer, word: str) -> list[list[int]]:
    """vLLM's tokenization of a bad word: bare, plus the leading-space form when it starts with a
    different token and has the same length."""
    bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
    spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
    out = [bare] if bare else []
    if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
        out.append(spaced)
    return out


def test_logits_processor_fields_match_transformers(tiny, llm):
    _, hf = tiny
    base = make_prompt(1)
    plain = run(llm, base, temperature=0.0, max_tokens=8, ignore_eos=True).outputs[0].token_ids
    prompt = base + plain[:6]  # tokens the model favoured appear in the prompt
    plain = run(llm, prompt, temperature=0.0, max_tokens=12).outputs[0].token_ids
    params_list, refs = [], []
    cases = _processor_cases(plain, llm.get_tokenizer())
    for _, kwargs, process, _ in cases:
        params_list.append(SamplingParams(temperature=0.0, max_tokens=12, **kwargs))
        refs.append(hf_greedy_processed(hf, prompt, 12, process))
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(cases), params_list, use_tqdm=False)  # one batch
    for (name, _, process, must_change), out, ref in zip(cases, outs, refs):
        ours = out.outputs[0].token_ids
        assert_greedy_equal(hf, prompt, ours, ref, process, name)
        assert ours != plain or not must_change, f"{name} should change the plain greedy output"
    by_name = {c[0]: out.outputs[0].token_ids for c, out in zip(cases, outs)}
    assert set(by_name["allowed_token_ids"]) <= set(cases[5][1]["allowed_token_ids"])
    assert EOS not in by_name["min_tokens"][:5] and by_name["min_tokens"][-1] == EOS


def test_min_tokens_stop_token_ids_and_ignore_eos(llm):
    prompt = make_prompt(2)
    forced = {EOS: 50.0}
    out = run(llm, prompt, temperature=0.0, max_tokens=10, logit_bias=forced).outputs[0]
    assert out.token_ids == [EOS] and out.finish_reason == "stop" and out.stop_reason is None
    out = run(llm, prompt, temperature=0.0, max_tokens=10, logit_bias=forced, min_tokens=3).outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == EOS and EOS not in out.token_ids[:3]
    out = run(llm, prompt, temperature=0.0, max_tokens=6, logit_bias=forced, ignore_eos=True).outputs[0]
    assert out.token_ids == [EOS] * 6 and out.finish_reason == "length"
    stop_tok = 777
    out = run(llm, prompt, temperature=0.0, max_tokens=10, logit_bias={stop_tok: 50.0}, stop_token_ids=[stop_tok],
              min_tokens=2).outputs[0]
    assert len(out.token_ids) == 3 and out.token_ids[-1] == stop_tok and stop_tok not in out.token_ids[:2]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert llm.get_tokenizer().decode([stop_tok]) not in out.text  # the stop id's text is not output


# -- logprobs --------------------------------------------------------------------------------------

def _check_position(lp_dict, raw: torch.Tensor, chosen: int, k: int, label: str) -> None:
    assert chosen in lp_dict, label
    top = raw.topk(k)
    expected = {chosen} | set(top.indices.tolist())
    assert set(lp_dict) == expected, f"{label}: ids {sorted(lp_dict)} vs {sorted(expected)}"
    for tid, lp in lp_dict.items():
        assert abs(lp.logprob - raw[tid].item()) < 1e-4, f"{label}: token {tid}"
    value = raw[chosen].item()  # rank = #(logprob >= chosen), up to float noise around the value
    assert int((raw >= value + 1e-4).sum()) <= lp_dict[chosen].rank <= int((raw >= value - 1e-4).sum()), label
    for r, tid in enumerate(top.indices.tolist(), start=1):
        if tid != chosen:
            assert lp_dict[tid].rank == r, label


def test_logprobs_match_transformers(tiny, llm):
    _, hf = tiny
    prompt = make_prompt(3)
    # Sampled with temperature and penalties: logprobs stay those of the raw distribution.
    for kwargs in (dict(temperature=0.0), dict(temperature=1.3, repetition_penalty=1.3, seed=4, top_k=40)):
        out = run(llm, prompt, max_tokens=8, logprobs=5, **kwargs).outputs[0]
        raw = hf_all_logprobs(hf, prompt + out.token_ids)
        assert len(out.logprobs) == len(out.token_ids)
        total = 0.0
        for j, (tok, d) in enumerate(zip(out.token_ids, out.logprobs)):
            _check_position(d, raw[len(prompt) + j - 1], tok, 5, f"{kwargs} pos {j}")
            total += raw[len(prompt) + j - 1, tok].item()
        assert math.isclose(out.cumulative_logprob, total, abs_tol=1e-3)
    out = run(llm, prompt, temperature=0.0, max_tokens=3, logprobs=0).outputs[0]
    assert all(len(d) == 1 for d in out.logprobs) and out.cumulative_logprob is not None
    out = run(llm, prompt, temperature=0.0, max_tokens=3).outputs[0]
    assert out.logprobs is None and out.cumulative_logprob is None


PROMPT_LOGPROB_CONFIGS = {
    "default": dict(),
    "chunked_16": dict(max_num_batched_tokens=16, max_num_seqs=8),
    "preempt": dict(num_gpu_blocks_override=24, block_size=4, max_num_seqs=8),
}


@pytest.mark.parametrize("config_name", list(PROMPT_LOGPROB_CONFIGS))
def test_prompt_logprobs_match_transformers(tiny, config_name):
    folder, hf = tiny
    engine = LLMEngine.from_engine_args(EngineArgs(model=folder, dtype="float32", **PROMPT_LOGPROB_CONFIGS[config_name]))
    rng = random.Random(5)
    prompts = [make_prompt(10 + i, rng.randint(1, 40)) for i in range(6)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p},
                           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=i % 3))
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        engine.engine_core.scheduler.check_integrity()
    if config_name == "preempt":
        assert engine.engine_core.scheduler.stats().num_preemptions_total > 0
    for i, p in enumerate(prompts):
        plp = results[f"r{i}"].prompt_logprobs
        assert len(plp) == len(p) and plp[0] is None, f"r{i}: {len(plp)} entries for {len(p)} prompt tokens"
        raw = hf_all_logprobs(hf, p)
        for j in range(1, len(p)):
            _check_position(plp[j], raw[j - 1], p[j], i % 3, f"{config_name} r{i} prompt pos {j}")


# -- seeds, n, best_of -------------------------------------------------------------------------------

def _others(n: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(7)
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.2, top_k=5, seed=3),
             dict(temperature=0.7, min_p=0.1, repetition_penalty=1.2, logprobs=2), dict(temperature=1.0)]
    return [(make_prompt(100 + i, rng.randint(2, 50)),
             SamplingParams(max_tokens=rng.randint(3, 16), ignore_eos=True, **kinds[i % len(kinds)]))
            for i in range(n)]


@pytest.mark.parametrize("config_name", ["default", "preempt"])
def test_seed_gives_same_text_alone_or_in_a_batch(tiny, llm, config_name):
    target_prompt = make_prompt(4, 30)
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=16, ignore_eos=True)
    alone = run(llm, target_prompt, temperature=0.9, top_p=0.95, seed=42, max_tokens=16, ignore_eos=True).outputs[0]
    engine_llm = llm if config_name == "default" else LLM(tiny[0], dtype="float32", num_gpu_blocks_override=40,
                                                         block_size=4, max_num_seqs=16)
    others = _others(32)
    prompts = [{"prompt_token_ids": p} for p, _ in others[:16]] + [{"prompt_token_ids": target_prompt}] + \
              [{"prompt_token_ids": p} for p, _ in others[16:]]
    params = [s for _, s in others[:16]] + [target] + [s for _, s in others[16:]]
    batched = engine_llm.generate(prompts, params, use_tqdm=False)[16].outputs[0]
    assert batched.token_ids == alone.token_ids and batched.text == alone.text
    if config_name == "preempt":
        assert engine_llm.llm_engine.engine_core.scheduler.stats().num_preemptions_total > 0
    other_seed = run(llm, target_prompt, temperature=0.9, top_p=0.95, seed=43, max_tokens=16, ignore_eos=True)
    assert other_seed.outputs[0].token_ids != alone.token_ids


def test_n_gives_n_outputs_sharing_the_prompt_blocks(llm):
    prompt = make_prompt(5, 70)
    stats = llm.llm_engine.engine_core.scheduler.stats
    hits_before = stats().prefix_cache_hits
    out = run(llm, prompt, n=4, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    block = llm.llm_engine.config.cache_config.block_size
    assert stats().prefix_cache_hits - hits_before >= 3 * (len(prompt) // block) * block, "siblings share the prompt"
    for i, c in enumerate(out.outputs):  # sequence i is seeded with seed + i
        single = run(llm, prompt, temperature=1.0, seed=11 + i, max_tokens=8, ignore_eos=True).outputs[0]
        assert single.token_ids == c.token_ids


def test_best_of_keeps_the_highest_cumulative_logprob(llm):
    prompt = make_prompt(6)
    common = dict(temperature=1.0, seed=21, max_tokens=6, ignore_eos=True)
    every = run(llm, prompt, n=5, logprobs=0, **common).outputs
    ranked = sorted(every, key=lambda c: c.cumulative_logprob, reverse=True)
    best = run(llm, prompt, n=2, best_of=5, **common).outputs
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best] == [0, 1]
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in best), "internal logprobs leaked"
    shown = run(llm, prompt, n=2, best_of=5, logprobs=1, **common).outputs
    assert [c.cumulative_logprob for c in shown] == pytest.approx([c.cumulative_logprob for c in ranked[:2]])
    assert all(len(c.logprobs) == 6 for c in shown)


# -- top-k / top-p / min-p support through the engine ------------------------------------------------

def test_sampled_tokens_stay_in_the_reference_support(tiny, llm):
    _, hf = tiny
    prompt = make_prompt(8)
    knobs = dict(temperature=0.6, top_k=12, top_p=0.7, min_p=0.02)
    ref = ref_probs(hf_last_logits(hf, prompt), **knobs)
    support = set(torch.nonzero(ref).flatten().tolist())
    params = [SamplingParams(max_tokens=1, seed=s, **knobs) for s in range(120)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False)
    drawn = [o.outputs[0].token_ids[0] for o in outs]
    assert set(drawn) <= support, f"drawn outside the nucleus: {set(drawn) - support}"
    top = max(support, key=lambda t: ref[t])
    assert abs(drawn.count(top) / len(drawn) - ref[top].item()) < 0.15
    assert len(set(drawn)) > 1


# -- detokenize, output kinds -------------------------------------------------------------------------

def test_detokenize_false_returns_ids_only(llm):
    prompt = make_prompt(9)
    out = run(llm, prompt, temperature=0.0, max_tokens=5, detokenize=False, logprobs=2).outputs[0]
    ref = run(llm, prompt, temperature=0.0, max_tokens=5).outputs[0]
    assert out.text == "" and out.token_ids == ref.token_ids
    assert all(lp.decoded_token is None for d in out.logprobs for lp in d.values())


def test_delta_output_kind_streams_pieces(tiny):
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny[0], dtype="float32"))
    prompt = {"prompt_token_ids": make_prompt(12)}
    common = dict(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1, n=2)
    engine.add_request("cum", prompt, SamplingParams(**common))
    engine.add_request("delta", prompt, SamplingParams(output_kind=RequestOutputKind.DELTA, **common))
    pieces = {0: ([], "", []), 1: ([], "", [])}
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "cum":
                final = out
                continue
            for c in out.outputs:
                ids, text, lps = pieces[c.index]
                pieces[c.index] = (ids + c.token_ids, text + c.text, lps + (c.logprobs or []))
    assert final.finished
    for c in final.outputs:
        ids, text, lps = pieces[c.index]
        assert ids == c.token_ids and text == c.text and [list(d) for d in lps] == [list(d) for d in c.logprobs]
        flat = [lp.logprob for d in lps for lp in d.values()]  # same values, up to batch-order float noise
        assert flat == pytest.approx([lp.logprob for d in c.logprobs for lp in d.values()], abs=1e-4)


def test_truncate_prompt_tokens_keeps_the_prompt_tail(llm):
    prompt = make_prompt(13, 30)
    out = run(llm, prompt, temperature=0.0, max_tokens=4, truncate_prompt_tokens=7)
    assert out.prompt_token_ids == prompt[-7:]
    assert out.outputs[0].token_ids == run(llm, prompt[-7:], temperature=0.0, max_tokens=4).outputs[0].token_ids
