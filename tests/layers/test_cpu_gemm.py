"""The prepacked oneDNN linear on the CPU equals F.linear, and the runner packs the model's layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers import Linear, LMHead, QKVLinear, VocabEmbedding, cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="this torch build has no oneDNN linear ops")


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    layer = Linear(96, 40, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(40, generator=gen))
    x = torch.randn(rows, 96, generator=gen)
    ref = F.linear(x, layer.weight, layer.bias)
    assert layer.pack_cpu_weight()
    out = layer(x)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # A non-contiguous input (a column slice, as the q/k/v split produces) is handled.
    wide = torch.randn(rows, 200, generator=gen)
    torch.testing.assert_close(layer(wide[:, 7:103]), F.linear(wide[:, 7:103], layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-5)


def test_only_float32_cpu_weights_are_packed():
    layer = Linear(32, 16)
    torch.nn.init.normal_(layer.weight)  # Linear allocates with torch.empty
    layer = layer.to(torch.bfloat16)
    assert not layer.pack_cpu_weight() and layer.cpu_packed_weight is None
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight))


def test_tied_lm_head_packs_its_own_copy_and_keeps_the_embedding():
    emb = VocabEmbedding(50, 24)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(50, 24))
    head = LMHead(50, 24, tied_to=emb)
    assert head.pack_cpu_weight()
    hidden = torch.randn(5, 24)
    torch.testing.assert_close(head(hidden), F.linear(hidden, emb.weight), rtol=1e-5, atol=1e-5)
    assert head.weight is emb.weight  # still one parameter: the embedding lookup is unchanged


def test_pack_linear_weights_counts_every_packable_layer():
    model = torch.nn.ModuleDict({"qkv": QKVLinear(32, 8, 4, 2), "o": Linear(32, 32), "head": LMHead(10, 32)})
    for p in model.parameters():
        torch.nn.init.normal_(p)
    assert cpu_gemm.pack_linear_weights(model) == 3
    x = torch.randn(4, 32)
    torch.testing.assert_close(model["qkv"](x), F.linear(x, model["qkv"].weight), rtol=1e-5, atol=1e-5)


def test_cpu_runner_packs_the_models_linears(tmp_path):
    from pagedllm import EngineArgs, LLMEngine
    from tests.helpers import make_tiny_model

    folder = make_tiny_model("llama", tmp_path / "llama")
    engine = LLMEngine.from_engine_args(EngineArgs(model=folder, device="cpu", dtype="float32"))
    model = engine.engine_core.runner.model
    layers = [m for m in model.modules() if isinstance(m, (Linear, LMHead))]
    assert layers and all(m.cpu_packed_weight is not None for m in layers)


def test_lm_head_upcast_false_keeps_the_model_dtype():
    head = LMHead(50, 24)
    torch.nn.init.normal_(head.weight)
    head = head.to(torch.bfloat16)
    hidden = torch.randn(3, 24, dtype=torch.bfloat16)
    native = head(hidden, upcast=False)
    assert native.dtype == torch.bfloat16 and torch.equal(native, F.linear(hidden, head.weight))
    assert torch.equal(head(hidden), native.float())
