"""Which model class serves a config, and how a model is built and loaded.

The architectures and the class serving each are the table of ``loader/architectures.py``; every
class is checked against the runner's interface (``models/interface.py``) when it is looked up and
every model when it is built.

``build_model`` constructs directly on the target device in the target dtype with uninitialized
weights (``torch.empty``: nothing is computed twice); ``load_model`` then fills them from the
checkpoint, and ``init_dummy_weights`` fills them with random values instead (benchmarks).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.loader.architectures import ARCHITECTURES, Architecture, architecture_for
from pagedllm.models.interface import check_model, check_model_class
from pagedllm.models.llama import sliding_window_of
from pagedllm.quantization import init_dummy_quantized_weights, process_quantized_weights, quantize_model


def supported_architectures() -> list[str]:
    return sorted(arch.hf_class for arch in ARCHITECTURES.values())


def model_class_of(arch: Architecture, runner: str = "generate") -> type[nn.Module]:
    """The class implementing ``arch`` for ``runner`` (its ``implementation``, or its
    ``pooling_implementation`` for "pooling", imported), checked against ``CausalLM``."""
    if runner == "pooling" and arch.pooling_implementation is None:
        raise ValueError(f"runner: {arch.hf_class} cannot be served as a pooling model")
    if runner != "pooling" and arch.is_encoder:
        raise ValueError(f"runner: {arch.hf_class} is an encoder-only model: serve it with runner='pooling'")
    implementation = arch.pooling_implementation if runner == "pooling" else arch.implementation
    module_name, class_name = implementation.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    check_model_class(cls, runner)
    return cls


def architecture_of(hf_config: Any) -> Architecture:
    """The entry for ``hf_config.architectures`` (first match), else for ``hf_config.model_type``."""
    model_type = getattr(hf_config, "model_type", None)
    archs = getattr(hf_config, "architectures", None)
    arch = architecture_for(archs, model_type)
    if arch is None:
        raise ValueError(
            f"model: architecture {archs} (model_type={model_type!r}) is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        )
    return arch


def get_model_class(hf_config: Any, runner: str = "generate") -> type[nn.Module]:
    """The class serving ``hf_config`` with ``runner`` ("generate" or "pooling")."""
    return model_class_of(architecture_of(hf_config), runner)


def max_supported_len(hf_config: Any) -> int | None:
    """A length cap the model itself imposes beyond ``max_position_embeddings``: the sliding window
    when the config turns one on (we attend in full, which is exact only below the window), else None."""
    return sliding_window_of(hf_config)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                quant_config: Any = None, runner: str = "generate") -> nn.Module:
    """The model for ``hf_config`` on ``device`` in ``dtype`` (floating parameters), weights uninitialized.
    RoPE tables stay float32. ``quant_config`` (a ``pagedllm.quantization.QuantizationConfig``):
    its linear layers get their quantization methods; the caller's load then ends with
    ``process_quantized_weights`` (``load_model`` and ``init_dummy_weights`` do)."""
    cls = get_model_class(hf_config, runner)
    if quant_config is not None and not getattr(cls, "supports_quantization", True):
        raise ValueError(f"quantization is not supported for {hf_config.model_type!r} models yet "
                         f"({cls.__name__} has no quantized form of its experts)")
    with torch.device(device), _default_dtype(dtype):
        model = cls(hf_config)
        quantize_model(model, quant_config)
    check_model(model, runner)
    return model.eval()


def load_model(source: Any, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
               quant_config: Any = None, runner: str = "generate") -> nn.Module:
    """``build_model`` + the checkpoint's weights. ``source`` is a ``pagedllm.loader.ModelSource`` (used
    through its ``iter_weights()`` method: models and loader do not import each other)."""
    model = build_model(hf_config, dtype, device, quant_config, runner)
    model.load_weights(source.iter_weights() if quant_config is None else quant_config.weight_iterator(source))
    process_quantized_weights(model)
    return model


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float | None = None) -> nn.Module:
    """Random weights for benchmarks and tests: normal(0, std) (std defaults to the config's
    ``initializer_range``), norm weights 1, biases 0, quantization scales 1 (packed int4: their
    scheme's random codes; then the quantized
    layers take their serving form). Deterministic for a given seed and device."""
    std = std if std is not None else float(getattr(model.config, "initializer_range", 0.02))
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.lower().endswith("norm.weight"):  # RMSNorm and LayerNorm (BERT's "LayerNorm.weight")
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        elif name.endswith(("_scale", "_scale_inv")):
            param.fill_(1.0)
        else:
            sample = torch.empty(param.shape, dtype=torch.float32, device=device)
            param.copy_(sample.normal_(0.0, std, generator=generator))
    init_dummy_quantized_weights(model, generator, std)  # packed int4: random codes, not copied floats
    process_quantized_weights(model)
    return model
