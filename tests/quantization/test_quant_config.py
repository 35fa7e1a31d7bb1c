"""Choosing the quantization scheme: ``quantization`` and the checkpoint's ``quantization_config``.
Every refusal is a ValueError whose message starts with ``quantization``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm.config import EngineArgs
from pagedllm.quantization import QUANTIZATION_METHODS, get_quantization_config
from pagedllm.quantization.compressed_tensors import CompressedTensorsConfig
from pagedllm.quantization.fp8 import Fp8Config
from tests.quantization.fp8_checkpoints import compressed_tensors_config, fp8_config

FLOAT = SimpleNamespace()  # a config without quantization_config


def ckpt(qcfg) -> SimpleNamespace:
    return SimpleNamespace(quantization_config=qcfg)


def test_names_and_no_quantization():
    assert sorted(QUANTIZATION_METHODS) == ["awq", "compressed-tensors", "fp8", "gguf", "gptq"]
    assert get_quantization_config(None, FLOAT) is None
    online = get_quantization_config("fp8", FLOAT)
    assert isinstance(online, Fp8Config) and not online.scheme.serialized and online.scheme.activations == "token"


@pytest.mark.parametrize("name", ["int3", "FP8", "", "GPTQ"])
def test_unknown_names_are_refused_with_the_supported_list(name):
    with pytest.raises(ValueError, match=r"^quantization must be one of \['awq', 'compressed-tensors', 'fp8', "
                                         r"'gguf', 'gptq'\] or None"):
        get_quantization_config(name, FLOAT)


def test_engine_args_refuse_a_quantization_that_is_not_a_string():
    with pytest.raises(ValueError, match=r"^quantization must be a string or None"):
        EngineArgs(quantization=8)
    assert EngineArgs(quantization="fp8").quantization == "fp8"


def test_the_checkpoint_scheme_is_used_and_a_conflicting_request_refused():
    assert get_quantization_config(None, ckpt(fp8_config())).scheme.serialized
    assert get_quantization_config("fp8", ckpt(fp8_config("static"))).scheme.activations == "static"
    ct = compressed_tensors_config()
    assert isinstance(get_quantization_config(None, ckpt(ct)), CompressedTensorsConfig)
    with pytest.raises(ValueError, match=r"^quantization='fp8' does not match the checkpoint's .*'compressed-tensors'"):
        get_quantization_config("fp8", ckpt(ct))


def test_a_scheme_that_needs_a_quantized_checkpoint_is_refused_on_a_float_one():
    with pytest.raises(ValueError, match=r"^quantization='compressed-tensors' needs a checkpoint quantized with it"):
        get_quantization_config("compressed-tensors", FLOAT)


def test_block_wise_fp8_is_read():
    scheme = get_quantization_config(None, ckpt(dict(fp8_config(), weight_block_size=[128, 128]))).scheme
    assert scheme.serialized and scheme.block == (128, 128)


def test_a_config_object_is_read_through_to_dict():
    obj = SimpleNamespace(to_dict=lambda: fp8_config())
    assert get_quantization_config(None, ckpt(obj)).scheme.serialized


BAD_CHECKPOINTS = {
    "unsupported method": ({"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes' is not supported"),
    "block size": (dict(fp8_config(), weight_block_size=[128]), r"weight_block_size must be two positive"),
    "static block-wise": (dict(fp8_config("static"), weight_block_size=[128, 128]), r"must be 'dynamic' with"),
    "fp8 activation scheme": (fp8_config("smooth"), r"activation_scheme must be 'dynamic' or 'static'"),
    "int8 weights": (
        {**compressed_tensors_config(), "config_groups": {"g": {"targets": ["Linear"], "weights": {
            "type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True}}}},
        r"weights: only 8-bit float"),
    "block strategy": (compressed_tensors_config("block"), r"weights.strategy must be 'tensor' or 'channel'"),
    "static per-token": (compressed_tensors_config("channel", {"type": "float", "num_bits": 8, "strategy": "token",
                                                               "dynamic": False}), r"input_activations: strategy"),
    "two groups": ({**compressed_tensors_config(), "config_groups": {"a": {}, "b": {}}}, r"exactly one group"),
    "other targets": (
        {**compressed_tensors_config(), "config_groups": {"g": {"targets": ["re:.*q_proj"], "weights": {}}}},
        r"targets \['re:\.\*q_proj'\]"),
    "kv cache scheme": (dict(compressed_tensors_config(), kv_cache_scheme={"type": "float", "num_bits": 8}),
                        r"kv_cache_scheme: an FP8 KV cache"),
    "sparse": (dict(compressed_tensors_config(), sparsity_config={"format": "sparse-24-bitmask"}),
               r"sparsity_config format 'sparse-24-bitmask'"),
    "packed format": (dict(compressed_tensors_config(), format="pack-quantized"), r"format 'pack-quantized'"),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_checkpoint_schemes_that_are_not_supported_are_refused(case):
    qcfg, message = BAD_CHECKPOINTS[case]
    with pytest.raises(ValueError, match=r"^quantization[ :=].*" + message):
        get_quantization_config(None, ckpt(qcfg))
