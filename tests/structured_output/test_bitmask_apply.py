"""apply_token_bitmask (xgrammar's kernel): every row or a subset, float32 and bfloat16, a
vocabulary that is not a multiple of 32; the caller's mask buffer is not kept."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.sample.bitmask import apply_token_bitmask


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
