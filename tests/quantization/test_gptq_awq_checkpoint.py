"""GPTQ and AWQ int4 checkpoints, packed in the test from the formats' published layouts, give the
logits of their dequantized float model (CPU reference path), and their configs are read or refused
with errors naming the field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.loader import load_hf_config, resolve_model
from pagedllm.models import build_model, init_dummy_weights, load_model
from pagedllm.quantization import get_quantization_config, int4
from pagedllm.quantization.awq import AWQConfig
from pagedllm.quantization.gptq import GPTQConfig
from tests.helpers import PagedTestRunner, make_tiny_model, tiny_config
from tests.quantization.int4_checkpoints import awq_config, gptq_config, pack_cols, write_int4_checkpoint

CHUNKS = ([(0, list(range(3, 40))), (1, list(range(50, 59)))], [(0, [100])], [(0, [101]), (1, [102])])


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("float") / "llama", seed=1)


@pytest.fixture(scope="module")
def plain_logits(tiny_folder):
    return logits_of(load(tiny_folder))


def logits_of(model) -> torch.Tensor:
    runner = PagedTestRunner(model, num_blocks=64, block_size=4)
    return torch.cat([torch.cat(runner.step(chunks)) for chunks in CHUNKS])


def load(folder: str, quantization: str | None = None):
    source = resolve_model(folder)
    hf_config = load_hf_config(source)
    return load_model(source, hf_config, torch.float32, "cpu", get_quantization_config(quantization, hf_config))


CASES = {
    "gptq-g32": gptq_config(32),
    "gptq-g32-act-order": gptq_config(32, desc_act=True),
    "gptq-per-channel-sym": gptq_config(-1, sym=True),
    "gptq-g16-act-order-sym": gptq_config(16, desc_act=True, sym=True),
    "awq-g32": awq_config(32),
    "awq-per-channel": awq_config(-1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_int4_checkpoint_gives_the_logits_of_its_dequantized_model(tiny_folder, plain_logits, tmp_path, case):
    qcfg = CASES[case]
    quant_dir, float_dir = write_int4_checkpoint(tiny_folder, tmp_path / case, qcfg)
    model = load(quant_dir, qcfg["quant_method"])
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert not hasattr(qkv, "weight") and qkv.qweight.dtype == torch.int32
    assert qkv.qweight.shape == (qkv.out_features, qkv.in_features // 8)  # 4 bits a weight
    assert (qkv.perm is not None) == qcfg.get("desc_act", False)
    got, want = logits_of(model), logits_of(load(float_dir))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, plain_logits, rtol=1e-3, atol=1e-3)  # the quantization shows


@pytest.mark.parametrize("case", ["gptq-g32-act-order", "awq-g32"])
def test_a_checkpoint_served_in_word_rows_gives_the_same_logits(tiny_folder, tmp_path, monkeypatch, case):
    """The load-time repack into the CUDA GEMV's word-row layout (``int4.N8_LAYOUT``, taken here on
    the CPU where K suits it: the down projections' 128 inputs), ``[N / 8, K]`` words read back by
    the reference product to the same logits."""
    quant_dir, float_dir = write_int4_checkpoint(tiny_folder, tmp_path / case, CASES[case])
    rows_model = load(quant_dir)
    monkeypatch.setattr(int4, "choose_layout", lambda device, k, group_size: int4.N8_LAYOUT
                        if int4.n8_run(k, group_size) else int4.ROWS_LAYOUT)
    model = load(quant_dir)
    down = model.model.layers[0].mlp.down_proj
    assert down.int4_layout == int4.N8_LAYOUT and down.qweight.shape == (down.out_features // 8, down.in_features)
    assert model.model.layers[0].self_attn.qkv_proj.int4_layout == int4.ROWS_LAYOUT  # 64 inputs
    assert rows_model.model.layers[0].mlp.down_proj.int4_layout == int4.ROWS_LAYOUT
    torch.testing.assert_close(logits_of(model), logits_of(rows_model), rtol=1e-5, atol=1e-5)


def test_layers_kept_in_float_stay_float(tiny_folder, tmp_path):
    qcfg = dict(awq_config(32), modules_to_not_convert=["mlp.down"])  # a substring, as vLLM reads it
    quant_dir, float_dir = write_int4_checkpoint(tiny_folder, tmp_path / "awq", qcfg, skip=("down_proj",))
    model = load(quant_dir)
    mlp = model.model.layers[1].mlp
    assert mlp.down_proj.quant_method is None and mlp.down_proj.weight.dtype == torch.float32
    assert mlp.gate_up_proj.qweight.dtype == torch.int32
    torch.testing.assert_close(logits_of(model), logits_of(load(float_dir)), rtol=1e-4, atol=1e-4)


def test_gptq_modules_in_block_to_quantize(tiny_folder, tmp_path):
    qcfg = dict(gptq_config(32), modules_in_block_to_quantize=[["self_attn.q_proj", "self_attn.k_proj",
                                                                  "self_attn.v_proj"], ["self_attn.o_proj"]])
    quant_dir, float_dir = write_int4_checkpoint(tiny_folder, tmp_path / "gptq", qcfg, skip=("mlp.",))
    model = load(quant_dir)
    layer = model.model.layers[0]
    assert layer.self_attn.o_proj.quant_method is not None and layer.mlp.gate_up_proj.quant_method is None
    torch.testing.assert_close(logits_of(model), logits_of(load(float_dir)), rtol=1e-4, atol=1e-4)


def test_merged_shards_with_different_act_orders_are_refused(tiny_folder, tmp_path):
    quant_dir, _ = write_int4_checkpoint(tiny_folder, tmp_path / "gptq", gptq_config(32, desc_act=True),
                                         shared_act_order=False)
    with pytest.raises(ValueError, match=r"^quantization: the merged projections .* different g_idx"):
        load(quant_dir)


def test_a_missing_g_idx_is_reported_like_a_missing_weight(tiny_folder, tmp_path):
    quant_dir, _ = write_int4_checkpoint(tiny_folder, tmp_path / "gptq", gptq_config(32))
    source = resolve_model(quant_dir)
    hf_config = load_hf_config(source)
    model = build_model(hf_config, torch.float32, "cpu", get_quantization_config(None, hf_config))
    weights = [(n, t) for n, t in source.iter_weights() if n != "model.layers.1.self_attn.k_proj.g_idx"]
    with pytest.raises(ValueError, match=r"missing weights \[model\.layers\.1\.self_attn\.qkv_proj\.g_idx\[k\]\]"):
        model.load_weights(weights)


def test_dummy_weights_dequantize_to_random_weights_of_the_requested_spread():
    hf_config = tiny_config("llama")
    hf_config.quantization_config = gptq_config(32, desc_act=True)
    model = init_dummy_weights(build_model(hf_config, torch.float32, "cpu", get_quantization_config(None, hf_config)),
                               std=0.05)
    down = model.model.layers[0].mlp.down_proj
    w = int4.dequantize(down.qweight, down.scales, down.zeros, 32)
    assert down.perm is not None and 0.03 < float(w.std()) < 0.07  # act-order: a random column order


def test_awq_nibble_order_and_gptq_zero_offset_are_the_published_ones():
    # AWQ: nibble i of a word holds column (0, 2, 4, 6, 1, 3, 5, 7)[i]; columns 0..7 hold their index.
    word = pack_cols(torch.arange(8)[None, :], (0, 2, 4, 6, 1, 3, 5, 7))
    assert int(word) == 0x75316420
    assert torch.equal(int4.unpack_cols(word, int4.AWQ_ORDER), torch.arange(8)[None, :].int())
    # GPTQ: rows packed in order along the input dim.
    assert torch.equal(int4.unpack_rows(torch.tensor([[0x76543210]], dtype=torch.int32)),
                       torch.arange(8, dtype=torch.int32)[:, None])


def ckpt(qcfg) -> SimpleNamespace:
    return SimpleNamespace(quantization_config=qcfg)


def test_configs_are_read():
    gptq = get_quantization_config("gptq", ckpt(gptq_config(128, desc_act=True)))
    assert isinstance(gptq, GPTQConfig) and gptq.group_size == 128 and gptq.desc_act and gptq.zero_offset == 1
    assert get_quantization_config(None, ckpt(dict(gptq_config(), checkpoint_format="gptq_v2"))).zero_offset == 0
    awq = get_quantization_config(None, ckpt({"quant_method": "awq", "w_bit": 4, "q_group_size": 64,
                                              "zero_point": True, "version": "GEMM"}))
    assert isinstance(awq, AWQConfig) and awq.group_size == 64
    assert "act-order" in gptq.describe() and "awq" in awq.describe()


@pytest.mark.parametrize("qcfg,message", [
    (dict(gptq_config(), bits=8), r"quantization_config\.bits=8 is not supported"),
    (dict(gptq_config(), group_size=0), r"quantization_config\.group_size must be -1 or a positive integer"),
    (dict(gptq_config(), checkpoint_format="marlin"), r"quantization_config\.checkpoint_format 'marlin'"),
    (dict(gptq_config(), lm_head=True), r"quantization_config\.lm_head"),
    (dict(gptq_config(), dynamic={"-:.*": {}}), r"quantization_config\.dynamic"),
    (dict(gptq_config(), desc_act="yes"), r"quantization_config\.desc_act must be true or false"),
    (dict(awq_config(), w_bit=3, bits=None), r"quantization_config\.bits=None"),
    (dict(awq_config(), zero_point=False), r"quantization_config\.zero_point must be true"),
    (dict(awq_config(), version="gemv"), r"quantization_config\.version 'gemv' is not supported"),
    (dict(awq_config(), q_group_size=7, group_size="x"), r"quantization_config\.group_size"),
])
def test_unsupported_configs_are_refused_naming_the_field(qcfg, message):
    with pytest.raises(ValueError, match=r"^quantization: " + message):
        get_quantization_config(None, ckpt(qcfg))


def test_a_quantization_that_does_not_match_the_checkpoint_is_refused():
    with pytest.raises(ValueError, match=r"^quantization='awq' does not match the checkpoint's .*'gptq'"):
        get_quantization_config("awq", ckpt(gptq_config()))
    with pytest.raises(ValueError, match=r"^quantization='gptq' needs a checkpoint quantized with it"):
        get_quantization_config("gptq", SimpleNamespace())


def test_shapes_the_packed_layout_cannot_hold_are_refused():
    hf_config = tiny_config("llama")
    hf_config.intermediate_size = 100  # gate/up shards of 100 rows: not a multiple of 8
    hf_config.quantization_config = awq_config(32)
    with pytest.raises(ValueError, match=r"^quantization='awq': a MergedLinear of 64 inputs"):
        build_model(hf_config, torch.float32, "cpu", get_quantization_config(None, hf_config))


def greedy_tokens(folder: str, **kwargs) -> list[list[int]]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(folder, max_model_len=256, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 30))}, {"prompt_token_ids": [7, 8, 9]}]
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def test_the_engine_serves_a_gptq_checkpoint_like_its_dequantized_model(tiny_folder, tmp_path):
    quant_dir, float_dir = write_int4_checkpoint(tiny_folder, tmp_path / "gptq", gptq_config(32, desc_act=True))
    assert greedy_tokens(quant_dir, quantization="gptq") == greedy_tokens(float_dir)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qcfg", [gptq_config(32, desc_act=True), awq_config(32)], ids=["gptq", "awq"])
def test_cuda_graphs_give_the_eager_tokens(tiny_folder, tmp_path, qcfg):
    """bf16 on CUDA: the decode CUDA graphs (int4 kernels captured) give the eager engine's tokens."""
    quant_dir, _ = write_int4_checkpoint(tiny_folder, tmp_path / "ckpt", qcfg)
    assert greedy_tokens(quant_dir, dtype="bfloat16") == greedy_tokens(quant_dir, dtype="bfloat16", enforce_eager=True)
