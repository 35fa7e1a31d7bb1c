"""The vectorised sampler against plain references (tests/sample/reference.py) on transformers' logits.

Logits come from a tiny random Llama run by transformers; every transform (penalties, logit bias,
allowed ids, bad words, min_tokens, temperature, min-p, top-k, top-p) is checked row by row in a
mixed batch, so per-row parameters must not leak into other rows.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedllm.sample.history import TokenHistory
from pagedllm.sample.sampler import Sampler, build_sampling_metadata
from pagedllm.sample.torch_sampling import processed_probs
from pagedllm.sampling_params import SamplingParams
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
NUM_ROWS = 8


@pytest.fixture(scope="module")
def hf_rows(tmp_path_factory):
    """(prompts, outputs, logits [NUM_ROWS, V]) from transformers: row i's logits are those after
    prompt_i + output_i. Outputs repeat prompt tokens and each other so penalties have work to do."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts, outputs = [], []
    for i in range(NUM_ROWS):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 12))]
        output = [rng.choice(prompt) for _ in range(i % 3)] + [rng.randrange(3, VOCAB) for _ in range(i % 4)]
        output += output[:2]  # repeats: frequency counts > 1
        prompts.append(prompt)
        outputs.append(output)
    with torch.inference_mode():
        logits = torch.stack([hf(torch.tensor([p + o])).logits[0, -1].float() for p, o in zip(prompts, outputs)])
    return prompts, outputs, logits


def process(logits: torch.Tensor, params: list[SamplingParams], prompts, outputs) -> tuple[torch.Tensor, object]:
    """Our logits processors applied to a copy of ``logits``; returns (processed logits, metadata)."""
    meta = build_sampling_metadata(params, TokenHistory.from_lists(prompts, outputs), torch.device("cpu"), VOCAB)
    x = logits.clone()
    for proc in meta.logits_processors:
        x = proc(x)
    return x, meta


def assert_rows_equal(ours: torch.Tensor, ref: torch.Tensor, label: str) -> None:
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(ours)), f"{label}: -inf masks differ"
    torch.testing.assert_close(ours[finite], ref[finite], rtol=1e-6, atol=1e-5, msg=label)


def test_penalties_match_reference(hf_rows):
    prompts, outputs, logits = hf_rows
    settings = [
        dict(repetition_penalty=1.3), dict(presence_penalty=0.7), dict(frequency_penalty=0.4),
        dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.1), dict(),
        dict(repetition_penalty=2.0, frequency_penalty=-1.0), dict(presence_penalty=2.0), dict(),
    ]
    params = [SamplingParams(**s) for s in settings]
    ours, _ = process(logits, params, prompts, outputs)
    for i, s in enumerate(settings):
        ref = ref_penalties(logits[i], prompts[i], outputs[i], s.get("presence_penalty", 0.0),
                            s.get("frequency_penalty", 0.0), s.get("repetition_penalty", 1.0))
        assert_rows_equal(ours[i], ref, f"row {i} {s}")
    changed = [i for i, s in enumerate(settings) if s and not torch.equal(ours[i], logits[i])]
    assert len(changed) == sum(1 for s in settings if s), "every penalised row must change"


def test_penalties_on_some_rows_only(hf_rows):
    prompts, outputs, logits = hf_rows
    params = [SamplingParams(repetition_penalty=1.5) if i == 3 else SamplingParams() for i in range(NUM_ROWS)]
    ours, _ = process(logits, params, prompts, outputs)
    for i in range(NUM_ROWS):
        ref = ref_penalties(logits[i], prompts[i], outputs[i], repetition=1.5) if i == 3 else logits[i]
        assert_rows_equal(ours[i], ref, f"row {i}")


def test_bias_allowed_bad_words_min_tokens_match_reference(hf_rows):
    prompts, outputs, logits = hf_rows
    eos = 2
    bias = {5: 3.5, 77: -2.0, int(logits[1].argmax()): -10.0}
    allowed = [11, 12, 13, 400, 9000]
    params = [SamplingParams() for _ in range(NUM_ROWS)]
    params[1] = SamplingParams(logit_bias=bias)
    params[2] = SamplingParams(allowed_token_ids=allowed)
    bad = [[outputs[3][-1], 42], [43], [outputs[3][-2], outputs[3][-1], 44], [1, 2, 45]]
    params[3] = SamplingParams()
    params[3]._bad_words_token_ids = bad
    params[4] = SamplingParams(min_tokens=len(outputs[4]) + 1, stop_token_ids=[7, 8])  # below min_tokens
    params[5] = SamplingParams(min_tokens=len(outputs[5]), stop_token_ids=[7])  # reached: no masking
    params[6] = SamplingParams(min_tokens=len(outputs[6]) + 2, ignore_eos=True)
    params[7] = SamplingParams(allowed_token_ids=allowed, logit_bias={400: 1.0}, repetition_penalty=1.2)
    for p in params:
        p._eos_token_id = eos
    ours, _ = process(logits, params, prompts, outputs)
    refs = [logits[i] for i in range(NUM_ROWS)]
    refs[1] = ref_logit_bias(logits[1], bias)
    refs[2] = ref_allowed(logits[2], allowed)
    refs[3] = ref_bad_words(logits[3], bad, outputs[3])
    refs[4] = ref_ban(logits[4], [7, 8, eos])
    refs[7] = ref_penalties(ref_logit_bias(ref_allowed(logits[7], allowed), {400: 1.0}), prompts[7], outputs[7],
                            repetition=1.2)
    for i in range(NUM_ROWS):
        assert_rows_equal(ours[i], refs[i], f"row {i}")
    assert not torch.isfinite(ours[3, [42, 43, 44]]).any() and torch.isfinite(ours[3, 45])


def test_processed_probs_match_reference_masks(hf_rows):
    _, _, logits = hf_rows
    settings = [
        dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.3), dict(temperature=0.5, min_p=0.2),
        dict(temperature=0.9, top_k=50, top_p=0.05), dict(temperature=1.0),
        dict(temperature=0.4, top_k=20, top_p=0.6, min_p=0.05), dict(temperature=2.0, top_k=1),
        dict(temperature=0.8, min_p=0.5, top_p=0.9),
    ]
    params = [SamplingParams(**s) for s in settings]
    history = TokenHistory.from_lists([[1]] * NUM_ROWS, [[]] * NUM_ROWS)
    meta = build_sampling_metadata(params, history, torch.device("cpu"), VOCAB)
    ours = probs_of(logits, meta)
    for i, s in enumerate(settings):
        ref = ref_probs(logits[i], **s)
        assert torch.equal(ref > 0, ours[i] > 0), f"row {i} {s}: support differs"
        torch.testing.assert_close(ours[i], ref, rtol=1e-4, atol=1e-6, msg=f"row {i} {s}")
    # A flat row (high temperature): the nucleus is longer than the top-p candidate list.
    flat = [SamplingParams(temperature=50.0, top_p=0.5), SamplingParams(temperature=50.0, top_p=0.999, top_k=30000)]
    meta = build_sampling_metadata(flat, TokenHistory.from_lists([[1]] * 2, [[]] * 2), torch.device("cpu"), VOCAB)
    ours = probs_of(logits[:2], meta)
    for i, p in enumerate(flat):
        ref = ref_probs(logits[i], temperature=50.0, top_p=p.top_p, top_k=p.top_k)
        assert (ref > 0).sum() > 1000 and torch.equal(ref > 0, ours[i] > 0), f"flat row {i}"
        torch.testing.assert_close(ours[i], ref, rtol=1e-4, atol=1e-7)


def probs_of(logits: torch.Tensor, meta) -> torch.Tensor:
    return processed_probs(logits.clone(), meta.temperature, meta.top_k, meta.top_p, meta.min_p, meta.max_top_k)


def test_draws_follow_the_processed_distribution(hf_rows):
    """8192 unseeded draws of one row (its first 2000 logits, to keep the batch small): empirical
    frequencies match the reference distribution."""
    _, _, logits = hf_rows
    n, vocab = 8192, 2000
    row = logits[2, :vocab]
    params = [SamplingParams(temperature=0.8, top_k=6, top_p=0.9)] * n
    history = TokenHistory.from_lists([[1]] * n, [[]] * n)
    meta = build_sampling_metadata(params, history, torch.device("cpu"), vocab)
    ids = Sampler(seed=1)(row.expand(n, -1).clone(), meta).token_ids
    ref = ref_probs(row, temperature=0.8, top_k=6, top_p=0.9)
    freq = torch.bincount(ids, minlength=vocab).float() / n
    assert set(ids.tolist()) <= set(torch.nonzero(ref).flatten().tolist())
    tv = 0.5 * (freq - ref).abs().sum().item()
    assert tv < 0.03, f"total variation {tv:.3f} between draws and reference"


def test_greedy_rows_take_the_argmax_of_processed_logits(hf_rows):
    prompts, outputs, logits = hf_rows
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.7, presence_penalty=1.0) for _ in range(NUM_ROWS)]
    params[0] = SamplingParams(temperature=0.0)
    params[1] = SamplingParams(temperature=1.0, seed=3)  # a random row in the same batch
    meta = build_sampling_metadata(params, TokenHistory.from_lists(prompts, outputs), torch.device("cpu"), VOCAB)
    ids = Sampler()(logits.clone(), meta).token_ids
    assert ids[0] == logits[0].argmax()
    for i in range(2, NUM_ROWS):
        ref = ref_penalties(logits[i], prompts[i], outputs[i], presence=1.0, repetition=1.7)
        assert ids[i] == ref.argmax(), f"row {i}"


def test_all_greedy_batch_sends_no_per_row_temperatures(hf_rows):
    prompts, outputs, logits = hf_rows
    params = [SamplingParams(temperature=0.0) for _ in range(NUM_ROWS)]
    meta = build_sampling_metadata(params, TokenHistory.from_lists(prompts, outputs), torch.device("cpu"), VOCAB)
    assert meta.all_greedy and meta.temperature is None and meta.greedy is None
    assert torch.equal(Sampler()(logits.clone(), meta).token_ids, logits.argmax(-1))


def test_seeded_rows_are_batch_and_position_invariant(hf_rows):
    prompts, outputs, logits = hf_rows
    target = SamplingParams(temperature=1.0, seed=1234, top_p=0.95)

    def draw(batch_rows: list[int], params: list[SamplingParams], where: int) -> int:
        hist = TokenHistory.from_lists([prompts[r] for r in batch_rows], [outputs[r] for r in batch_rows])
        meta = build_sampling_metadata(params, hist, torch.device("cpu"), VOCAB)
        return int(Sampler(seed=len(batch_rows))(logits[batch_rows].clone(), meta).token_ids[where])

    alone = draw([5], [target], 0)
    others = [SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=0.0), SamplingParams(seed=9)]
    assert draw([1, 5, 2, 3], [others[0], target, others[1], others[2]], 1) == alone
    assert draw([3, 2, 5], [others[2], others[0], target], 2) == alone
    # A different output position (same seed) gives an independent draw: over a few positions they differ.
    draws = set()
    for extra in range(6):
        hist = TokenHistory.from_lists([prompts[5]], [outputs[5] + [7] * extra])
        meta = build_sampling_metadata([SamplingParams(temperature=5.0, seed=1234)], hist, torch.device("cpu"), VOCAB)
        draws.add(int(Sampler()(logits[5:6].clone(), meta).token_ids[0]))
    assert len(draws) > 1


def test_logprobs_are_raw_with_ranks(hf_rows):
    prompts, outputs, logits = hf_rows
    params = [SamplingParams(temperature=0.0, logprobs=4, repetition_penalty=1.5, logit_bias={9: 30.0})
              for _ in range(NUM_ROWS)]
    params[1] = SamplingParams(temperature=1.5, top_k=3, logprobs=2, seed=5)
    params[2] = SamplingParams()  # no logprobs in the same batch
    meta = build_sampling_metadata(params, TokenHistory.from_lists(prompts, outputs), torch.device("cpu"), VOCAB)
    out = Sampler()(logits.clone(), meta)
    raw = torch.log_softmax(logits, -1)
    assert out.logprob_token_ids.shape == (NUM_ROWS, 5)
    for i in (0, 1, 3):
        tok = int(out.token_ids[i])
        assert out.logprob_token_ids[i, 0] == tok
        assert math.isclose(out.logprobs[i, 0].item(), raw[i, tok].item(), abs_tol=1e-5)
        assert out.sampled_ranks[i] == int((raw[i] >= raw[i, tok]).sum())
        top = raw[i].topk(4)
        assert out.logprob_token_ids[i, 1:].tolist() == top.indices.tolist()
        torch.testing.assert_close(out.logprobs[i, 1:], top.values)
    assert out.token_ids[0] == 9 and out.sampled_ranks[0] > 1  # the bias chose it; the raw rank says otherwise
