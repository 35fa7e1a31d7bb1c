"""apply_token_bitmask (xgrammar's kernel): every row or a subset, float32 and bfloat16, a
vocabulary that is not a multiple of 32; the caller's mask buffer is not kept."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.sample.bitmask import BitmaskApplier, apply_token_bitmask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [[0, 1, 2], [2, 0]])
def test_masked_rows_keep_only_their_allowed_tokens(dtype, rows):
    vocab = 77
    rng = np.random.default_rng(0)
    bits = rng.random((len(rows), vocab)) < 0.3
    words = np.packbits(np.pad(bits, ((0, 0), (0, 96 - vocab))), axis=-1, bitorder="little").view(np.int32)
    logits = torch.randn(3, vocab).to(dtype)
    before = logits.clone()
    apply_token_bitmask(logits, rows, words)
    words[:] = 0  # the buffer may be reused at once
    for j, row in enumerate(rows):
        assert torch.isfinite(logits[row]).numpy().tolist() == bits[j].tolist()
        assert torch.equal(logits[row][bits[j]], before[row][bits[j]])
    for row in set(range(3)) - set(rows):
        assert torch.equal(logits[row], before[row])


def reference_mask(logits: torch.Tensor, rows: list[int], words: np.ndarray) -> torch.Tensor:
    """The masked logits computed with plain torch ops: bit t of a row's words clear -> -inf."""
    vocab = logits.shape[-1]
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, :vocab].astype(bool)
    out = logits.clone()
    for j, row in enumerate(rows):
        out[row][~torch.from_numpy(bits[j]).to(logits.device)] = float("-inf")
    return out


def random_step(rng: np.random.Generator, num_rows: int, vocab: int, device: str, dtype=torch.float32):
    rows = sorted(rng.choice(num_rows, size=rng.integers(1, num_rows + 1), replace=False).tolist())
    bits = rng.random((len(rows), vocab)) < 0.2
    width = (vocab + 31) // 32 * 32
    words = np.packbits(np.pad(bits, ((0, 0), (0, width - vocab))), axis=-1, bitorder="little").view(np.int32)
    return rows, words, torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30)))).to(device, dtype)


def test_one_applier_reused_over_steps_equals_the_torch_reference():
    """A ``BitmaskApplier`` keeps its staging buffers between steps (other heights, mixed and full
    batches): each step's result equals the reference, whatever the steps before it staged."""
    applier, rng = BitmaskApplier("cpu"), np.random.default_rng(1)
    for num_rows in (5, 3, 8, 8, 2):
        rows, words, logits = random_step(rng, num_rows, 100, "cpu")
        expected = reference_mask(logits, rows, words)
        applier.apply(logits, rows, words)
        assert torch.equal(logits, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_applier_on_the_gpu_equals_the_torch_reference(dtype):
    """The pinned, asynchronous copy and xgrammar's Triton kernel: each step equals the reference,
    and the caller's words may be overwritten right after ``apply`` (they were staged)."""
    applier, rng = BitmaskApplier("cuda"), np.random.default_rng(2)
    for num_rows in (256, 7, 256, 40, 300):
        rows, words, logits = random_step(rng, num_rows, 49152 + 5, "cuda", dtype)
        expected = reference_mask(logits, rows, words)
        applier.apply(logits, rows, words)
        words[:] = 0
        torch.cuda.synchronize()
        assert torch.equal(logits, expected)
