"""The CPU decode path of packed GGUF layers: the norm / activation prologues and the lean
per-segment product, against the dequantized float model and the checked kernel."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import KernelConfig
from pagedllm.layers.dispatch import prepare_model_kernels
from pagedllm.native import kernels as native
from pagedllm.quantization.gguf import GGUFConfig, GGUFLinearMethod
from tests.helpers import PagedTestRunner, has_default_model
from tests.native.test_gguf_kernels import random_blocks

needs_kernels = pytest.mark.skipif(native.load() is None, reason="no C compiler to build the CPU kernels")
needs_default_model = pytest.mark.skipif(not has_default_model(), reason="needs the embedded SmolLM2 and gguf")


@pytest.fixture(scope="module")
def packed_and_plain():
    from pagedllm.loader import load_hf_config, resolve_model
    from pagedllm.models.registry import load_model

    source = resolve_model(None)
    config = load_hf_config(source)
    with pytest.MonkeyPatch.context() as mp:  # float activations: the exact packed products
        mp.setenv("PAGEDLLM_GGUF_INT8_ACTIVATIONS", "0")
        packed = load_model(source, config, torch.float32, "cpu", GGUFConfig())
    plain = load_model(source, config, torch.float32, "cpu", None)
    return packed, plain


@needs_kernels
@needs_default_model
def test_decode_through_the_prologues_equals_the_dequantized_model(packed_and_plain, monkeypatch):
    """With the engine's kernel plan on the CPU, the packed layers take the norm / activation
    prologues (every layer, every step) and the logits stay within 1e-3 of the float model's."""
    packed, plain = packed_and_plain
    prepare_model_kernels(packed, torch.device("cpu"), KernelConfig())
    qkv = packed.model.layers[0].self_attn.qkv_proj
    assert qkv.quantized_fusions and qkv.weight.gguf_cpu_segments is not None
    calls = {"norm": 0, "act": 0}
    for name, kind in (("apply_norm_prologue", "norm"), ("apply_act_prologue", "act")):
        real = getattr(GGUFLinearMethod, name)

        def counted(self, *args, _real=real, _kind=kind):
            out = _real(self, *args)
            calls[_kind] += out is not None
            return out

        monkeypatch.setattr(GGUFLinearMethod, name, counted)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (20, 5)]
    outs = {}
    for name, model in (("packed", packed), ("plain", plain)):
        runner = PagedTestRunner(model, num_blocks=32, block_size=16)
        logits = runner.step([(0, prompts[0]), (1, prompts[1])])
        logits += runner.step([(0, [5]), (1, [6])])
        logits += runner.step([(0, [11])])
        outs[name] = torch.cat(logits)
    layers = len(packed.model.layers)
    assert calls == {"norm": 2 * layers * 3, "act": layers * 3}  # 3 steps; qkv and gate_up norms
    rel = float((outs["packed"] - outs["plain"]).abs().max() / outs["plain"].abs().max())
    assert rel < 1e-3, rel
    assert torch.equal(outs["packed"].argmax(-1), outs["plain"].argmax(-1))


@needs_kernels
@needs_default_model
def test_without_the_c_kernels_the_prologues_stay_off(packed_and_plain):
    packed, _ = packed_and_plain
    prepare_model_kernels(packed, torch.device("cpu"), KernelConfig(cpu_kernels=False))
    assert not packed.model.layers[0].self_attn.qkv_proj.quantized_fusions
    prepare_model_kernels(packed, torch.device("cpu"), KernelConfig())  # back, for the other tests


@needs_kernels
@pytest.mark.parametrize("m", [1, 5])
def test_segments_product_equals_the_checked_kernel(m):
    """Two segments of different formats side by side in one output, as a merged layer holds them."""
    from gguf import GGMLQuantizationType

    k = 256
    parts = [(int(GGMLQuantizationType[name]), torch.from_numpy(random_blocks(name, rows, k, seed=rows)))
             for name, rows in (("Q4_1", 20), ("Q6_K", 12))]
    x = torch.randn(m, k + 4, generator=torch.Generator().manual_seed(m))[:, :k]
    ref = torch.empty(m, 32)
    native.gguf_matmul(x, parts[0][1], parts[0][0], ref[:, :20])
    native.gguf_matmul(x, parts[1][1], parts[1][0], ref[:, 20:])
    out = torch.full((m, 32), float("nan"))
    native.gguf_matmul_segments(x, ((parts[0][0], parts[0][1], 0), (parts[1][0], parts[1][1], 20)), out)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="do not hold 128 weights"):
        native.gguf_matmul_segments(x[:, :128], ((parts[0][0], parts[0][1], 0),), out)
