"""The sampler on CUDA agrees with the CPU path: processors, masks, greedy ids, logprobs; draws stay
inside the support (the noise differs between devices, the distribution does not)."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.sample.history import TokenHistory
from pagedllm.sample.sampler import Sampler, build_sampling_metadata
from pagedllm.sample.torch_sampling import processed_probs
from pagedllm.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB = 32000


def _batch():
    rng = random.Random(0)
    settings = [
        dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=1.4, presence_penalty=0.5, logprobs=3),
        dict(temperature=0.8, top_p=0.9, seed=3), dict(temperature=1.2, top_k=20, min_p=0.05, frequency_penalty=0.7),
        dict(temperature=0.7, allowed_token_ids=[5, 6, 7, 900]), dict(temperature=0.0, logit_bias={17: 9.0}),
        dict(temperature=1.0, min_tokens=10, stop_token_ids=[3, 4]), dict(temperature=0.5, top_p=0.3, top_k=100),
    ]
    params = [SamplingParams(**s) for s in settings]
    for p in params:
        p._eos_token_id = 2
    params[0]._bad_words_token_ids = [[11, 12], [13]]
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 30))] for _ in params]
    outputs = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))] + [11] for _ in params]
    return params, TokenHistory.from_lists(prompts, outputs)


def test_cuda_matches_cpu():
    params, history = _batch()
    logits = torch.randn(len(params), VOCAB) * 4
    metas = {d: build_sampling_metadata(params, history, torch.device(d), VOCAB) for d in ("cpu", "cuda")}
    processed = {}
    for d, meta in metas.items():
        x = logits.clone().to(d)
        for proc in meta.logits_processors:
            x = proc(x)
        processed[d] = x
    torch.testing.assert_close(processed["cuda"].cpu(), processed["cpu"])
    probs = {d: processed_probs(processed[d], m.temperature, m.top_k, m.top_p, m.min_p, m.max_top_k).cpu()
             for d, m in metas.items()}
    torch.testing.assert_close(probs["cuda"], probs["cpu"], rtol=1e-4, atol=1e-6)
    outs = {d: Sampler(device=d)(logits.clone().to(d), m) for d, m in metas.items()}
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    assert outs["cuda"].token_ids.cpu()[greedy].tolist() == outs["cpu"].token_ids[greedy].tolist()
    for i, tok in enumerate(outs["cuda"].token_ids.cpu().tolist()):
        assert probs["cpu"][i, tok] > 0, f"row {i} drew token {tok} outside its support"
    torch.testing.assert_close(outs["cuda"].logprobs.cpu()[greedy], outs["cpu"].logprobs[greedy])


def test_seeded_rows_repeat_on_cuda():
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=7)] * 4
    history = TokenHistory.from_lists([[1, 2, 3]] * 4, [[]] * 4)
    logits = torch.randn(1, VOCAB, device="cuda").expand(4, -1).contiguous()
    meta = build_sampling_metadata(params, history, torch.device("cuda"), VOCAB)
    first = Sampler(seed=1, device="cuda")(logits.clone(), meta).token_ids
    again = Sampler(seed=2, device="cuda")(logits.clone(), meta).token_ids
    assert torch.equal(first, again) and len(set(first.tolist())) == 1  # same seed, same position, same draw
