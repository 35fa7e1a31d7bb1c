"""The schemes by name, the choice of one for a checkpoint, and its application to a built model."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.layers.embedding import LMHead, VocabEmbedding
from pagedllm.layers.linear import Linear
from pagedllm.quantization.awq import AWQConfig
from pagedllm.quantization.base import QuantizationConfig
from pagedllm.quantization.compressed_tensors import CompressedTensorsConfig
from pagedllm.quantization.fp8 import Fp8Config
from pagedllm.quantization.gguf import GGUFConfig, gguf_quantization
from pagedllm.quantization.gptq import GPTQConfig
from pagedllm.quantization.int4 import Int4LinearMethod

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    cls.name: cls for cls in (Fp8Config, CompressedTensorsConfig, GPTQConfig, AWQConfig, GGUFConfig)
}


def checkpoint_quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """config.json's ``quantization_config`` as a dict (transformers may give an object), or None."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None or isinstance(raw, dict):
        return raw
    return raw.to_dict()


def get_quantization_config(quantization: str | None, hf_config: Any, source_kind: str | None = None,
                            load_format: str = "auto") -> QuantizationConfig | None:
    """The scheme the engine serves with: the checkpoint's (``quantization_config``), which a given
    ``quantization`` must name, else the requested one applied at load, else None. ValueErrors
    name ``quantization``: an unknown name, a checkpoint scheme not supported, or a conflict. A
    GGUF file (``source_kind`` "gguf") implies "gguf" unless told otherwise (``gguf.gguf_quantization``)."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {sorted(QUANTIZATION_METHODS)} or None, got {quantization!r}")
    requested = quantization
    quantization = gguf_quantization(quantization, source_kind, load_format)
    if quantization == "gguf":
        return GGUFConfig(packed_on_gpu=requested == "gguf")
    checkpoint = checkpoint_quantization_config(hf_config)
    if checkpoint is None:
        return QUANTIZATION_METHODS[quantization].online() if quantization is not None else None
    method = checkpoint.get("quant_method")
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: the checkpoint's quantization_config.quant_method {method!r} is not "
                         f"supported (supported: {sorted(QUANTIZATION_METHODS)})")
    if quantization is not None and quantization != method:
        raise ValueError(f"quantization={quantization!r} does not match the checkpoint's quantization_config."
                         f"quant_method={method!r}: leave quantization unset or set it to {method!r}")
    return QUANTIZATION_METHODS[method].from_config(checkpoint)


def quantize_model(model: nn.Module, quant_config: QuantizationConfig | None) -> int:
    """Give every linear layer of a freshly built ``model`` its quantization method (``create_weights``
    runs now, before any load); returns how many layers are quantized. The model's
    ``packed_modules_mapping`` tells the config which checkpoint modules a merged layer stands for."""
    if quant_config is None:
        return 0
    quant_config.packed_modules_mapping = dict(getattr(model, "packed_modules_mapping", {}))
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, (Linear, VocabEmbedding, LMHead)):
            method = quant_config.get_quant_method(module, name)
            if method is not None:
                module.set_quant_method(method)
                count += 1
    return count


def process_quantized_weights(model: nn.Module) -> None:
    """After the load: every quantized layer takes its serving form (``process_weights_after_loading``)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, (Linear, VocabEmbedding, LMHead)) and method is not None:
            method.process_weights_after_loading(module)


def init_dummy_quantized_weights(model: nn.Module, generator: torch.Generator, std: float) -> None:
    """Dummy weights: the quantized layers whose scheme says how (packed int4) get random values of
    their checkpoint form (before ``process_quantized_weights``) that dequantize to about ``std``."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, Linear) and isinstance(method, Int4LinearMethod):
            method.init_dummy_weights(module, generator, std)
