"""FP8 checkpoints (vLLM's ``fp8`` and ``compressed-tensors``) load as they are and compute what their
dequantized float model computes; ``quantization="fp8"`` quantizes a float checkpoint at load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from pagedllm.config import EngineArgs
from pagedllm.engine.config_builder import create_engine_config
from pagedllm.layers import Linear
from pagedllm.loader import load_hf_config, resolve_model
from pagedllm.models import build_model, init_dummy_weights, load_model
from pagedllm.quantization import fp8_ops, get_quantization_config, process_quantized_weights, quantize_model
from pagedllm.quantization.fp8 import Fp8Config
from tests.helpers import PagedTestRunner, make_tiny_model, tiny_config
from tests.quantization.fp8_checkpoints import (
    compressed_tensors_config,
    fp8_config,
    reference_model,
    write_fp8_checkpoint,
)

CHUNKS = ([(0, list(range(3, 40))), (1, list(range(50, 59)))], [(0, [100])], [(0, [101]), (1, [102])])


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("float") / "llama", seed=1)


def logits_of(model) -> torch.Tensor:
    runner = PagedTestRunner(model, num_blocks=64, block_size=4)
    return torch.cat([torch.cat(runner.step(chunks)) for chunks in CHUNKS])


def assert_same_numbers(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 summation order. An activation whose float value lands next to an FP8
    rounding boundary may round the other way in one of the two (a one-step change of one element),
    so a few elements may differ by a little more: bounded on all, tight on average."""
    diff = (got - want).abs()
    assert float(diff.max()) < 0.05 and float(diff.mean()) < 1e-4, (float(diff.max()), float(diff.mean()))


def load(folder: str, quantization: str | None = None):
    source = resolve_model(folder)
    hf_config = load_hf_config(source)
    quant_config = get_quantization_config(quantization, hf_config)
    return load_model(source, hf_config, torch.float32, "cpu", quant_config), hf_config


CASES = {  # name: (quantization_config, per_channel, static input_scale, activations as served)
    "fp8-tensor-dynamic": (fp8_config("dynamic"), False, False, "token"),
    "fp8-tensor-static": (fp8_config("static"), False, True, "static"),
    "ct-channel-token": (compressed_tensors_config("channel", {"type": "float", "num_bits": 8, "strategy": "token",
                                                                "dynamic": True}), True, False, "token"),
    "ct-tensor-tensor": (compressed_tensors_config("tensor", {"type": "float", "num_bits": 8, "strategy": "tensor",
                                                               "dynamic": True}), False, False, "tensor"),
    "ct-channel-weight-only": (compressed_tensors_config("channel", None), True, False, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_checkpoint_gives_the_logits_of_its_dequantized_model(tiny_folder, tmp_path, case):
    qcfg, per_channel, static, activations = CASES[case]
    folder = write_fp8_checkpoint(tiny_folder, tmp_path / case, qcfg, per_channel, static)
    model, hf_config = load(folder)
    weights = {n: p for n, p in model.named_parameters() if n.endswith("proj.weight")}
    assert weights and all(p.dtype == torch.float8_e4m3fn for p in weights.values())
    if static:
        assert float(model.model.layers[0].self_attn.qkv_proj.input_scale) == pytest.approx(0.02)
    got = logits_of(model)
    want = logits_of(reference_model(hf_config, folder, activations))
    assert_same_numbers(got, want)
    # And the quantization shows: the float checkpoint's logits differ.
    plain = logits_of(load(tiny_folder)[0])
    assert not torch.allclose(got, plain, rtol=1e-3, atol=1e-3)


def test_block_wise_fp8_checkpoint_gives_the_logits_of_its_dequantized_model(tiny_folder, tmp_path):
    """16x16 blocks (tiny shapes; real checkpoints use 128x128): every merged shard starts on a block."""
    qcfg = dict(fp8_config("dynamic"), weight_block_size=[16, 16])
    folder = write_fp8_checkpoint(tiny_folder, tmp_path / "block", qcfg, per_channel=False)
    model, hf_config = load(folder)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale_inv.shape == (128 // 16, 64 // 16)
    assert not hasattr(qkv, "weight_scale")
    want = logits_of(reference_model(hf_config, folder, "token", block=(16, 16)))
    assert_same_numbers(logits_of(model), want)
    # 128-row blocks do not divide the tiny qkv (q: 64 rows, then k): refused at build, naming the field.
    hf_config.quantization_config = dict(fp8_config("dynamic"), weight_block_size=[128, 128])
    with pytest.raises(ValueError, match=r"^quantization: quantization_config.weight_block_size \[128, \.\.\.\]"):
        build_model(hf_config, torch.float32, "cpu", get_quantization_config(None, hf_config))


def test_merged_shards_keep_their_own_per_tensor_scales(tiny_folder, tmp_path):
    folder = write_fp8_checkpoint(tiny_folder, tmp_path / "ckpt", fp8_config(), per_channel=False)
    model, _ = load(folder)
    qkv = model.model.layers[0].self_attn.qkv_proj
    scales = load_file(f"{folder}/model.safetensors")
    q = float(scales["model.layers.0.self_attn.q_proj.weight_scale"])
    k = float(scales["model.layers.0.self_attn.k_proj.weight_scale"])
    assert q != k
    assert torch.equal(qkv.weight_scale[:qkv.q_size], torch.full((qkv.q_size,), q))
    assert torch.equal(qkv.weight_scale[qkv.q_size:qkv.q_size + qkv.kv_size], torch.full((qkv.kv_size,), k))


def test_ignored_layers_stay_float(tiny_folder, tmp_path):
    acts = {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}
    qcfg = compressed_tensors_config("channel", acts, ignore=["lm_head", "re:.*mlp.down_proj$"])
    folder = write_fp8_checkpoint(tiny_folder, tmp_path / "ckpt", qcfg, True, skip=("down_proj",))
    model, hf_config = load(folder)
    mlp = model.model.layers[1].mlp
    assert mlp.down_proj.quant_method is None and mlp.down_proj.weight.dtype == torch.float32
    assert mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    want = logits_of(reference_model(hf_config, folder, "token", skip=("down_proj",)))
    assert_same_numbers(logits_of(model), want)


def test_an_ignore_list_that_splits_a_merged_layer_is_refused(tiny_folder):
    hf_config = tiny_config("llama")
    hf_config.quantization_config = compressed_tensors_config("channel", None, ignore=["re:.*k_proj$"])
    with pytest.raises(ValueError, match=r"^quantization: .*ignores only some of .*qkv_proj"):
        build_model(hf_config, torch.float32, "cpu", get_quantization_config(None, hf_config))


def test_a_missing_scale_is_reported_like_a_missing_weight(tiny_folder, tmp_path):
    folder = write_fp8_checkpoint(tiny_folder, tmp_path / "ckpt", fp8_config(), per_channel=False)
    source = resolve_model(folder)
    hf_config = load_hf_config(source)
    model = build_model(hf_config, torch.float32, "cpu", get_quantization_config(None, hf_config))
    weights = [(n, t) for n, t in source.iter_weights() if n != "model.layers.1.self_attn.v_proj.weight_scale"]
    with pytest.raises(ValueError, match=r"missing weights \[model\.layers\.1\.self_attn\.qkv_proj\.weight_scale\[v\]\]"):
        model.load_weights(weights)


def test_online_fp8_matches_its_dequantized_model_and_takes_one_byte_per_weight(tiny_folder):
    model, hf_config = load(tiny_folder, "fp8")
    float_model, _ = load(tiny_folder)
    linears = {n: p for n, p in model.named_parameters() if n.endswith("proj.weight")}
    assert len(linears) == 4 * hf_config.num_hidden_layers
    for name, p in linears.items():
        assert p.dtype == torch.float8_e4m3fn and p.element_size() == 1
        assert p.untyped_storage().nbytes() == p.numel(), "1 byte per weight, no float copy kept"
        float_bytes = dict(float_model.named_parameters())[name].untyped_storage().nbytes()
        assert p.untyped_storage().nbytes() * 4 == float_bytes
    # Not in the model: the float weights it was quantized from.
    assert not any(p.dtype == torch.float32 and n.endswith("proj.weight") for n, p in model.named_parameters())
    # The dequantized model, with per-token activation quantization, gives the same logits.
    ref = build_model(hf_config, torch.float32, "cpu")
    weights = []
    for name, p in model.named_parameters():
        if name.endswith("proj.weight"):
            scale = dict(model.named_parameters())[name.replace(".weight", ".weight_scale")]
            weights.append((name, p.float() * scale[:, None]))
        elif not name.endswith("_scale"):
            weights.append((name, p))
    ref.load_weights(weights)  # our merged names: each merged tensor loads whole
    for module in ref.modules():
        if isinstance(module, Linear):
            def forward(x, m=module):
                xq, s = fp8_ops.quantize_activations(x, None)
                return F.linear(xq.float() * s, m.weight, m.bias)
            module.forward = forward
    assert_same_numbers(logits_of(model), logits_of(ref))


def test_dummy_weights_work_with_online_and_checkpoint_fp8(tiny_folder, tmp_path):
    hf_config = tiny_config("llama")
    model = init_dummy_weights(build_model(hf_config, torch.float32, "cpu", Fp8Config.online()), seed=1)
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert torch.isfinite(logits_of(model)).all()
    hf_config.quantization_config = fp8_config("static")
    model = init_dummy_weights(build_model(hf_config, torch.float32, "cpu",
                                           get_quantization_config(None, hf_config)), seed=1)
    assert float(model.model.layers[0].self_attn.o_proj.input_scale) == 1.0
    assert torch.isfinite(logits_of(model)).all()
    hf_config.quantization_config = dict(fp8_config(), weight_block_size=[16, 16])
    model = init_dummy_weights(build_model(hf_config, torch.float32, "cpu",
                                           get_quantization_config(None, hf_config)), seed=1)
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight_scale_inv, torch.ones(4, 8))
    assert torch.isfinite(logits_of(model)).all()


def test_quantize_model_without_a_config_changes_nothing():
    model = build_model(tiny_config("llama"), torch.float32, "cpu")
    assert quantize_model(model, None) == 0
    process_quantized_weights(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_engine_config_reads_the_checkpoint_scheme(tiny_folder, tmp_path):
    folder = write_fp8_checkpoint(tiny_folder, tmp_path / "ckpt", fp8_config(), per_channel=False)
    config = create_engine_config(EngineArgs(model=folder))
    assert config.model_config.quant_config.name == "fp8" and config.model_config.quant_config.scheme.serialized
    assert create_engine_config(EngineArgs(model=folder, quantization="fp8")).model_config.quant_config.name == "fp8"
    with pytest.raises(ValueError, match=r"^quantization='compressed-tensors' does not match .*quant_method='fp8'"):
        create_engine_config(EngineArgs(model=folder, quantization="compressed-tensors"))
    online = create_engine_config(EngineArgs(model=tiny_folder, quantization="fp8")).model_config.quant_config
    assert online.name == "fp8" and not online.scheme.serialized
    assert create_engine_config(EngineArgs(model=tiny_folder)).model_config.quant_config is None
    with pytest.raises(ValueError, match=r"^quantization must be one of \[.*'fp8'.*\] or None, got 'int3'"):
        create_engine_config(EngineArgs(model=tiny_folder, quantization="int3"))


# ---- CUDA (the lead runs these on a GPU) -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["fp8-tensor-static", "ct-channel-token", "ct-channel-weight-only"])
def test_fp8_checkpoint_on_cuda_in_bfloat16_stays_near_the_cpu_float32_run(tiny_folder, tmp_path, case):
    """The same checkpoint on CUDA in bfloat16 (``_scaled_mm`` on Hopper, the tiled product for the
    weight-only scheme): the logits of the float32 CPU run up to bfloat16 rounding."""
    from pagedllm.attention.triton_backend import TritonBackend

    qcfg, per_channel, static, _ = CASES[case]
    folder = write_fp8_checkpoint(tiny_folder, tmp_path / case, qcfg, per_channel, static)
    want = logits_of(load(folder)[0])
    source = resolve_model(folder)
    hf_config = load_hf_config(source)
    model = load_model(source, hf_config, torch.bfloat16, "cuda", get_quantization_config(None, hf_config))
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    runner = PagedTestRunner(model, num_blocks=64, block_size=4, backend=TritonBackend())
    got = torch.cat([torch.cat(runner.step(chunks)) for chunks in CHUNKS]).float().cpu()
    assert torch.isfinite(got).all()
    assert float((got - want).abs().mean()) < 0.05 * float(want.abs().mean())
