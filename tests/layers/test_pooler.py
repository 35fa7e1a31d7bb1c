"""Pooling and the encoder ops against plain torch: chunk partials merged over steps equal pooling
the whole prompt (MEAN / CLS / LAST), truncation and normalization per request, and bidirectional
attention over a ragged batch (native; the CUDA varlen form against it on a GPU)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.backend import common_inputs_from_lists, forward_context
from pagedllm.attention.torch_ref import TorchRefBackend
from pagedllm.layers.encoder import EncoderAttention
from pagedllm.layers.pooler import Pooler

LENS = [5, 1, 9, 3]


def _whole(kind: str, h: torch.Tensor) -> torch.Tensor:
    return {"MEAN": h.mean(0), "CLS": h[0], "LAST": h[-1]}[kind]


@pytest.mark.parametrize("kind", ["MEAN", "CLS", "LAST"])
def test_chunk_partials_merged_over_steps_equal_whole_prompt_pooling(kind):
    torch.manual_seed(0)
    prompts = [torch.randn(n, 16) for n in LENS]
    pooler = Pooler(kind)
    merged: list[torch.Tensor | None] = [None] * len(prompts)
    for chunk in range(3):  # each step computes the next third of every prompt
        parts = [p[(len(p) * chunk) // 3 : (len(p) * (chunk + 1)) // 3] for p in prompts]
        live = [i for i, part in enumerate(parts) if len(part)]
        qsl = torch.tensor([0] + torch.tensor([len(parts[i]) for i in live]).cumsum(0).tolist(), dtype=torch.int32)
        partials = pooler.chunk_partials(torch.cat([parts[i] for i in live]), qsl, len(live))
        for row, i in enumerate(live):
            merged[i] = partials[row] if merged[i] is None else pooler.merge(merged[i], partials[row])
    lens = torch.tensor(LENS)
    dims = torch.tensor([16, 16, 4, 16])
    normalize = torch.tensor([True, False, True, True])
    out = pooler.finish(torch.stack(merged), lens, dims, normalize)
    for i, p in enumerate(prompts):
        expected = _whole(kind, p)[: dims[i]]
        if normalize[i]:
            expected = torch.nn.functional.normalize(expected, dim=0)
        torch.testing.assert_close(out[i, : dims[i]], expected)
        assert not out[i, dims[i]:].any()


def test_unknown_pooling_type_is_refused():
    with pytest.raises(ValueError, match="^pooling_type"):
        Pooler("MAX")


def _reference_attention(q, k, v, lens, scale):
    out, start = [], 0
    for n in lens:
        s = torch.einsum("qhd,khd->hqk", q[start:start + n], k[start:start + n]) * scale
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v[start:start + n]))
        start += n
    return torch.cat(out).flatten(1)


def _run(attn: EncoderAttention, q, k, v, lens, device):
    meta = TorchRefBackend().metadata_builder.build(common_inputs_from_lists(lens, lens, [[0]] * len(lens),
                                                                             [-1] * sum(lens), device))
    with forward_context(meta, TorchRefBackend()):
        return attn(q.flatten(1), k.flatten(1), v.flatten(1))


def test_encoder_attention_is_bidirectional_per_prompt():
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(LENS), 4, 8) for _ in range(3))
    attn = EncoderAttention(4, 8, 8**-0.5)
    torch.testing.assert_close(_run(attn, q, k, v, LENS, "cpu"), _reference_attention(q, k, v, LENS, 8**-0.5))


def test_encoder_attention_refuses_a_partial_prompt():
    q = torch.randn(3, 32)
    meta = TorchRefBackend().metadata_builder.build(common_inputs_from_lists([3], [5], [[0, 1]], [-1] * 3, "cpu"))
    with forward_context(meta, TorchRefBackend()), pytest.raises(ValueError, match="whole prompts"):
        EncoderAttention(4, 8, 1.0)(q, q, q)


@pytest.mark.gpu
def test_encoder_attention_varlen_on_cuda_matches_native():
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(LENS), 4, 32, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    attn = EncoderAttention(4, 32, 32**-0.5)
    attn.use_impl("cuda")
    out = _run(attn, q, k, v, LENS, "cuda")
    torch.testing.assert_close(out.float(), _reference_attention(q.float(), k.float(), v.float(), LENS, 32**-0.5),
                               atol=2e-2, rtol=2e-2)
