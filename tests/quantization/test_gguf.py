"""``quantization="gguf"``: which GGUF path a model takes, and the packed embedded SmolLM2 (Q4_1
linears, Q8_0 embedding and tied head) against its dequantized-float model."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.quantization import get_quantization_config
from pagedllm.quantization.gguf import GGUFConfig, gguf_quantization
from tests.helpers import PagedTestRunner, has_default_model

needs_default_model = pytest.mark.skipif(not has_default_model(), reason="needs the embedded SmolLM2 and gguf")


@pytest.mark.parametrize(("quantization", "kind", "load_format", "expected"), [
    (None, "gguf", "auto", "gguf"),  # vLLM: a GGUF file implies quantization="gguf"
    ("gguf", "gguf", "gguf", "gguf"),
    (None, "gguf", "gguf_dequantized", None),  # the float path, asked for by name
    ("fp8", "gguf", "auto", "fp8"),  # another scheme quantizes the dequantized weights
    (None, "gguf", "dummy", None),
    (None, "hf", "auto", None),
])
def test_a_gguf_file_implies_gguf_unless_told_otherwise(quantization, kind, load_format, expected):
    assert gguf_quantization(quantization, kind, load_format) == expected


@pytest.mark.parametrize(("quantization", "kind", "load_format", "field"), [
    ("gguf", "hf", "auto", "quantization"),
    ("gguf", "gguf", "dummy", "quantization"),
    ("gguf", "gguf", "gguf_dequantized", "quantization"),
    (None, "hf", "gguf", "load_format"),
    (None, "hf", "gguf_dequantized", "load_format"),
])
def test_contradictions_are_refused_naming_the_field(quantization, kind, load_format, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        gguf_quantization(quantization, kind, load_format)


def test_registry_serves_gguf_for_a_gguf_file_and_load_format_is_validated():
    assert isinstance(get_quantization_config(None, object(), "gguf", "auto"), GGUFConfig)
    assert get_quantization_config(None, object(), "gguf", "gguf_dequantized") is None
    with pytest.raises(ValueError, match="^load_format"):
        EngineArgs(load_format="gguf_float")


@pytest.fixture(scope="module")
def smollm2_pair():
    from pagedllm.loader import load_hf_config, resolve_model
    from pagedllm.models.registry import load_model

    source = resolve_model(None)
    config = load_hf_config(source)
    with pytest.MonkeyPatch.context() as mp:  # float activations: the exact packed products
        mp.setenv("PAGEDLLM_GGUF_INT8_ACTIVATIONS", "0")
        packed = load_model(source, config, torch.float32, "cpu", GGUFConfig())
    plain = load_model(source, config, torch.float32, "cpu", None)
    return packed, plain


@needs_default_model
def test_packed_model_holds_its_blocks(smollm2_pair):
    packed, plain = smollm2_pair
    qkv = packed.model.layers[0].self_attn.qkv_proj.weight
    assert qkv.dtype == torch.uint8 and [s.qtype for s in qkv.gguf_segments] == [3]  # Q4_1, one segment
    assert packed.lm_head.weight is packed.model.embed_tokens.weight  # tied: one Q8_0 table
    assert packed.lm_head.weight.gguf_segments[0].qtype == 8
    packed_bytes = sum(p.numel() * p.element_size() for p in packed.parameters())
    plain_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    assert packed_bytes < plain_bytes / 5, (packed_bytes, plain_bytes)
    linear_weights = sum(m.in_features * m.out_features for m in packed.modules()
                         if getattr(m, "in_features", None) and getattr(m, "quant_method", None))
    linear_bytes = sum(m.weight.numel() for m in packed.modules()
                       if getattr(m, "in_features", None) and getattr(m, "quant_method", None))
    assert linear_bytes * 8 / linear_weights == 5.0  # Q4_1: 20 bytes per 32 weights


@needs_default_model
def test_packed_logits_equal_the_dequantized_models(smollm2_pair):
    """Prefill (the tiled path, > 64 rows), a mixed batch and decode steps (the register kernel)."""
    packed, plain = smollm2_pair
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (150, 7)]
    outs = {}
    for name, model in (("packed", packed), ("plain", plain)):
        runner = PagedTestRunner(model, num_blocks=64, block_size=16)
        logits = runner.step([(0, prompts[0]), (1, prompts[1])])
        logits += runner.step([(0, [5]), (1, [6])])
        logits += runner.step([(0, [11])])
        outs[name] = torch.cat(logits)
    ours, ref = outs["packed"], outs["plain"]
    rel = float((ours - ref).abs().max() / ref.abs().max())
    assert rel < 1e-3, rel
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def _random_gguf(name: str, rows: int, cols: int, seed: int):
    from gguf import GGMLQuantizationType

    from pagedllm.loader.gguf_file import GGUFTensor
    from tests.native.test_gguf_kernels import random_blocks

    raw = torch.from_numpy(random_blocks(name, rows, cols, seed))
    return GGUFTensor(int(GGMLQuantizationType[name]), (rows, cols), raw)


@pytest.mark.parametrize("packed_kernel", [True, False])  # False: no C compiler, dequantized at load
def test_merged_layer_with_shards_of_several_formats(monkeypatch, packed_kernel):
    """q in Q4_K, k in Q6_K, v in Q5_0 (no kernel: dequantized at load): three segments, one product."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from pagedllm.layers.linear import QKVLinear
    from pagedllm.loader.gguf_file import GGUFTensor
    from pagedllm.quantization import gguf as gguf_module

    monkeypatch.setattr(gguf_module, "has_packed_kernel", lambda device: packed_kernel)
    layer = QKVLinear(256, 32, 4, 2, bias=True)
    layer.set_quant_method(gguf_module.GGUFLinearMethod())
    shards = {"q": _random_gguf("Q4_K", 128, 256, 1), "k": _random_gguf("Q6_K", 64, 256, 2)}
    v_float = torch.randn(64, 256, generator=torch.Generator().manual_seed(4)).numpy()
    shards["v"] = GGUFTensor(int(GGMLQuantizationType.Q5_0), (64, 256),
                             torch.from_numpy(quantize(v_float, GGMLQuantizationType.Q5_0)))
    for shard_id, t in shards.items():
        layer.weight.weight_loader(layer.weight, t, shard_id)
    layer.bias.data.copy_(torch.randn(256))
    layer.quant_method.process_weights_after_loading(layer)
    # Q4_K (12) and Q6_K (14) stay packed; Q5_0 has no kernel: F32 rows. Without kernels: a float layer.
    if packed_kernel:
        assert [s.qtype for s in layer.weight.gguf_segments] == [12, 14, 0]
    else:
        assert layer.quant_method is None and layer.weight.dtype == torch.float32
    w = torch.cat([t.dequantize() for t in shards.values()])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    ref = torch.nn.functional.linear(x, w, layer.bias)
    torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    big = torch.randn(200, 256, generator=torch.Generator().manual_seed(6))  # the tiled path
    torch.testing.assert_close(layer(big), torch.nn.functional.linear(big, w, layer.bias), rtol=1e-4, atol=1e-3)


def test_a_shard_of_the_wrong_shape_is_refused():
    from pagedllm.layers.linear import MergedLinear
    from pagedllm.quantization.gguf import GGUFLinearMethod

    layer = MergedLinear(256, [64, 64])
    layer.set_quant_method(GGUFLinearMethod())
    with pytest.raises(ValueError, match="does not match"):
        layer.weight.weight_loader(layer.weight, _random_gguf("Q8_0", 32, 256, 0), 0)


def test_without_a_kernel_a_layer_becomes_a_float_layer_in_the_model_dtype(monkeypatch):
    """A GPU (no packed kernel): q/k/v dequantized once into one bfloat16 matrix, and the layer is a
    plain float layer again (no quantization method, the fused-kernel flags of its class), so the
    kernel plan dispatches it as a float checkpoint's: the same GEMM at 1 row as at 6."""
    from pagedllm.layers.linear import QKVLinear
    from pagedllm.quantization import gguf as gguf_module
    from pagedllm.quantization.registry import process_quantized_weights

    monkeypatch.setattr(gguf_module, "has_packed_kernel", lambda device: False)
    layer = QKVLinear(256, 32, 4, 2, bias=True)
    layer.weight.data = layer.weight.data.to(torch.bfloat16)
    layer.bias.data = torch.randn(256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    layer.set_quant_method(gguf_module.GGUFLinearMethod())
    shards = {"q": _random_gguf("Q4_K", 128, 256, 1), "k": _random_gguf("Q6_K", 64, 256, 2),
              "v": _random_gguf("Q8_0", 64, 256, 3)}
    for shard_id, t in shards.items():
        layer.weight.weight_loader(layer.weight, t, shard_id)
    process_quantized_weights(torch.nn.ModuleList([layer]))
    dense = torch.cat([t.dequantize() for t in shards.values()]).to(torch.bfloat16)
    assert layer.quant_method is None and layer.fuses_kernels and layer.gemm_tunable
    assert layer.weight.dtype == torch.bfloat16 and torch.equal(layer.weight, dense)
    for rows in (1, 6):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        assert torch.equal(layer(x), torch.nn.functional.linear(x, dense, layer.bias))


def test_without_a_kernel_the_tied_table_becomes_a_float_table_in_the_model_dtype(monkeypatch):
    from pagedllm.layers.embedding import LMHead, VocabEmbedding
    from pagedllm.quantization import gguf as gguf_module
    from pagedllm.quantization.registry import process_quantized_weights

    monkeypatch.setattr(gguf_module, "has_packed_kernel", lambda device: False)
    embed = VocabEmbedding(96, 64)
    embed.weight.data = embed.weight.data.to(torch.bfloat16)
    head = LMHead(96, 64, tied_to=embed)
    for layer in (embed, head):
        layer.set_quant_method(gguf_module.GGUFEmbeddingMethod())
    table = _random_gguf("Q8_0", 96, 64, 7)
    embed.weight.weight_loader(embed.weight, table)
    process_quantized_weights(torch.nn.ModuleList([embed, head]))
    dense = table.dequantize().to(torch.bfloat16)
    assert head.weight is embed.weight and torch.equal(embed.weight, dense)
    assert embed.quant_method is None and head.quant_method is None and head.fuses_kernels
    ids = torch.tensor([0, 5, 95])
    assert torch.equal(embed(ids), dense[ids])
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    assert torch.equal(head(hidden, upcast=False), torch.nn.functional.linear(hidden, dense))


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and has_default_model()), reason="needs CUDA and SmolLM2")
def test_on_cuda_the_blocks_stay_packed_and_logits_match_the_dequantized_model():
    """CUDA with quantization="gguf" given: the Triton kernels multiply the packed blocks in bfloat16 (GEMV at 1-4 rows, the tiled
    GEMM above, the gather for the embedding); logits agree with the bf16 dequantized model's."""
    from pagedllm.loader import load_hf_config, resolve_model
    from pagedllm.models.registry import load_model

    source = resolve_model(None)
    config = load_hf_config(source)
    packed = load_model(source, config, torch.bfloat16, "cuda", GGUFConfig(packed_on_gpu=True))
    plain = load_model(source, config, torch.bfloat16, "cuda", None)
    implied = load_model(source, config, torch.bfloat16, "cuda", GGUFConfig())  # a GGUF file without quantization=
    assert implied.model.layers[0].self_attn.qkv_proj.quant_method is None
    qkv = packed.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.uint8 and qkv.quant_method is not None
    assert packed.lm_head.weight.dtype == torch.uint8
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (150, 7)]
    outs = {}
    for name, model in (("packed", packed), ("plain", plain)):
        runner = PagedTestRunner(model, num_blocks=64, block_size=16)
        logits = runner.step([(0, prompts[0]), (1, prompts[1])])
        logits += runner.step([(0, [5]), (1, [6])])
        outs[name] = torch.cat(logits).float()
    rel = float((outs["packed"] - outs["plain"]).abs().max() / outs["plain"].abs().max())
    assert rel < 3e-2, rel


def test_on_a_gpu_blocks_stay_packed_only_when_gguf_is_asked_for(monkeypatch):
    """A GGUF file implies quantization="gguf": packed on the CPU, dequantized into the model dtype on
    a GPU (faster there); quantization="gguf" given explicitly keeps the blocks packed on the GPU."""
    from pagedllm.quantization import gguf as gguf_module
    from pagedllm.quantization.registry import get_quantization_config

    monkeypatch.setattr(gguf_module, "has_packed_kernel", lambda device: True)
    implied = get_quantization_config(None, object(), "gguf", "auto")
    explicit = get_quantization_config("gguf", object(), "gguf", "auto")
    assert not implied.packed_on_gpu and explicit.packed_on_gpu
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert gguf_module.keeps_packed(cpu, False) and gguf_module.keeps_packed(cpu, True)
    assert not gguf_module.keeps_packed(cuda, False) and gguf_module.keeps_packed(cuda, True)
    assert "dequantized into the model dtype on a GPU" in implied.describe()
    from pagedllm.layers.linear import Linear

    for config, packed in ((implied, False), (explicit, True)):
        method = config.get_quant_method(Linear(32, 8), "layer")
        assert method.packed_on_gpu is packed
