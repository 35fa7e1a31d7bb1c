"""The fused sampler (GPU) draws from softmax(logits / T); greedy rows take the argmax."""

import pytest
import torch

from pagedllm.sample import triton_sampling

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_greedy_rows_are_argmax():
    logits = torch.randn(37, 50_000, device="cuda", dtype=torch.bfloat16)
    n = logits.shape[0]
    out = triton_sampling.categorical_sample(logits, torch.ones(n, device="cuda"),
                                             torch.ones(n, dtype=torch.bool, device="cuda"), torch.arange(n, device="cuda"))
    assert torch.equal(out, logits.float().argmax(-1))


def test_ties_take_the_lowest_index():
    logits = torch.zeros(2, 10_000, device="cuda")
    logits[:, 7] = logits[:, 3000] = logits[:, 9000] = 5.0  # 9000 lies in another chunk
    out = triton_sampling.categorical_sample(logits, torch.ones(2, device="cuda"),
                                             torch.ones(2, dtype=torch.bool, device="cuda"),
                                             torch.zeros(2, dtype=torch.int64, device="cuda"))
    assert out.tolist() == [7, 7]


def test_samples_follow_softmax_with_temperature():
    torch.manual_seed(0)
    base = torch.randn(12, device="cuda") * 2
    rows, temp = 40_000, 0.7
    logits = base.expand(rows, -1).contiguous()
    seeds = torch.arange(rows, dtype=torch.int64, device="cuda") * 7919 + 3
    out = triton_sampling.categorical_sample(logits, torch.full((rows,), temp, device="cuda"),
                                        torch.zeros(rows, dtype=torch.bool, device="cuda"), seeds)
    freq = torch.bincount(out, minlength=12).float() / rows
    expected = torch.softmax(base / temp, -1)
    assert (freq - expected).abs().max() < 0.01, (freq, expected)
    again = triton_sampling.categorical_sample(logits, torch.full((rows,), temp, device="cuda"),
                                          torch.zeros(rows, dtype=torch.bool, device="cuda"), seeds)
    assert torch.equal(out, again), "same seeds must give the same draws"


def test_winner_in_any_chunk_of_a_large_vocab():
    """Rows are split into chunks of columns; the reduce must pick the right chunk's winner."""
    vocab = 151_936
    logits = torch.randn(5, vocab, device="cuda", dtype=torch.bfloat16)
    for row, col in enumerate([0, 4095, 4096, 100_000, vocab - 1]):
        logits[row, col] = 50.0
    n = logits.shape[0]
    out = triton_sampling.categorical_sample(logits, torch.ones(n, device="cuda"),
                                             torch.ones(n, dtype=torch.bool, device="cuda"), torch.arange(n, device="cuda"))
    assert out.tolist() == [0, 4095, 4096, 100_000, vocab - 1]


def test_rare_tokens_are_drawn_at_their_rate():
    """Unlikely tokens own thin slices of the inverse CDF; a draw that rounded their boundaries too
    coarsely would shift these frequencies."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.045, 0.004, 0.001], device="cuda")
    rows, temp = 400_000, 0.5
    logits = (probs.log() * temp).expand(rows, -1).contiguous()  # softmax(logits / T) == probs
    seeds = torch.arange(rows, dtype=torch.int64, device="cuda") * 104_729 + 11
    out = triton_sampling.categorical_sample(logits, torch.full((rows,), temp, device="cuda"),
                                        torch.zeros(rows, dtype=torch.bool, device="cuda"), seeds)
    freq = torch.bincount(out, minlength=len(probs)).float() / rows
    sigma = (probs * (1 - probs) / rows).sqrt()
    assert ((freq - probs).abs() < 5 * sigma).all(), (freq, probs)


def test_all_greedy_argmax_matches_torch():
    logits = torch.randn(19, 151_936, device="cuda", dtype=torch.bfloat16)
    logits[3, 100] = logits[3, 140_000] = 30.0  # a tie across chunks: the lower index wins
    assert torch.equal(triton_sampling.greedy_argmax(logits), logits.float().argmax(-1))
    assert triton_sampling.greedy_argmax(logits[:0]).shape == (0,)


def test_ids_can_also_land_in_pinned_host_memory():
    """With ``host_out`` the reduce kernel stores the ids into pinned memory too (no device->host copy)."""
    logits = torch.randn(9, 151_936, device="cuda", dtype=torch.bfloat16)
    n = logits.shape[0]
    for draw in (lambda host: triton_sampling.greedy_argmax(logits, host),
                 lambda host: triton_sampling.categorical_sample(logits, torch.full((n,), 0.8, device="cuda"),
                                                            torch.zeros(n, dtype=torch.bool, device="cuda"),
                                                            torch.arange(n, device="cuda"), host)):
        host = torch.full((n,), -1, dtype=torch.int64).pin_memory()
        out = draw(host)
        torch.cuda.synchronize()
        assert torch.equal(host, out.cpu()) and torch.equal(out, draw(None))


def test_draws_spread_over_chunks_and_groups_follow_softmax():
    """The draw picks a chunk, then a group of columns in it, then a column: mass placed at chunk and
    group edges (and in the last, partial chunk) must come out at its softmax rate, and columns of
    no mass (a -inf logit, or one far below the rest) never."""
    vocab, rows = 151_936, 200_000
    base = torch.full((vocab,), -40.0, device="cuda")
    hot = torch.tensor([0, 63, 64, 4095, 4096, 81_919, 151_935], device="cuda")
    base[hot] = torch.tensor([0.0, -0.5, -1.0, 0.3, -2.0, 0.1, -0.2], device="cuda")
    base[1] = float("-inf")
    logits = base.to(torch.bfloat16).expand(rows, -1)
    greedy = torch.zeros(rows, dtype=torch.bool, device="cuda")
    greedy[::1000] = True  # greedy rows mixed in take the argmax
    seeds = torch.arange(rows, dtype=torch.int64, device="cuda") * 104_729 + 5
    out = triton_sampling.categorical_sample(logits, torch.ones(rows, device="cuda"), greedy, seeds)
    assert (out[greedy] == 4095).all()
    drawn = out[~greedy]
    assert torch.isin(drawn, hot).all()
    probs = torch.softmax(base.to(torch.bfloat16).float(), -1)[hot]
    freq = torch.stack([(drawn == h).float().mean() for h in hot])
    sigma = (probs * (1 - probs) / drawn.numel()).sqrt()
    assert ((freq - probs).abs() < 5 * sigma).all(), (freq, probs)
