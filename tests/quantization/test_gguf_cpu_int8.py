"""GGUF on the CPU with int8 activations (``PAGEDLLM_GGUF_INT8_ACTIVATIONS=1``, off by default): the
layers take the integer kernel when the variable says so at load, and the embedded SmolLM2 keeps its
perplexity.

Tolerance (measured on the embedded Q4_1 SmolLM2, the fp8 accuracy test's text): rounding each
32-value activation block to int8 moves the logits by up to ~5% of their largest value (the same
as llama.cpp, which computes this way), far above the 1e-3 of the exact float-activation path
(``test_gguf.py``, run with the variable off), but the teacher-forced perplexity by 0.1% (26.582
against 26.608): the bound here is 1%."""

from __future__ import annotations

import pytest
import torch

from pagedllm.native import kernels as native
from tests.helpers import has_default_model

gguf = pytest.importorskip("gguf")
needs_int8 = pytest.mark.skipif(not native.gguf_q8_supported(3), reason="no int8 GGUF kernel on this CPU")


def _q4_1_layer():
    from pagedllm.layers.linear import Linear
    from pagedllm.quantization import gguf as gguf_module
    from tests.quantization.test_gguf import _random_gguf

    layer = Linear(256, 40, bias=False)
    layer.set_quant_method(gguf_module.GGUFLinearMethod())
    t = _random_gguf("Q4_1", 40, 256, 7)
    layer.weight.weight_loader(layer.weight, t)
    layer.quant_method.process_weights_after_loading(layer)
    return layer, t


@needs_int8
@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("rows", [3, 200])  # decode-sized, and past PREFILL_MIN_ROWS
def test_the_variable_read_at_load_picks_the_kernel(monkeypatch, int8, rows):
    monkeypatch.setenv("PAGEDLLM_GGUF_INT8_ACTIVATIONS", "1" if int8 else "0")
    layer, t = _q4_1_layer()
    monkeypatch.setenv("PAGEDLLM_GGUF_INT8_ACTIVATIONS", "0" if int8 else "1")  # too late: read at load
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    got = layer(x)
    if int8:
        ref = native.gguf_matmul(x, t.data, t.qtype, torch.empty(rows, 40), int8_activations=True)
        assert torch.equal(got, ref)
    else:
        ref = x @ t.dequantize().t()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@needs_int8
@pytest.mark.skipif(not has_default_model(), reason="needs the embedded SmolLM2 and gguf")
def test_int8_activations_keep_the_perplexity_of_the_dequantized_model(monkeypatch):
    from pagedllm import LLM
    from tests.quantization.test_fp8_accuracy import perplexity

    args = dict(dtype="float32", max_model_len=512, max_num_seqs=1, enable_prefix_caching=False)
    monkeypatch.setenv("PAGEDLLM_GGUF_INT8_ACTIVATIONS", "1")
    int8, n = perplexity(LLM(**args))
    plain, _ = perplexity(LLM(load_format="gguf_dequantized", **args))
    assert n > 250
    assert abs(int8 - plain) / plain < 0.01, (plain, int8)  # -0.1% when measured
    assert int8 != plain, "the activations' rounding must show"
