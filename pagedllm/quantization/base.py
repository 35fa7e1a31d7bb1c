"""What a quantization scheme provides, in vLLM's shape: a config read once, and a method per layer.

- ``QuantizationConfig``: one scheme's settings, built from the checkpoint's ``quantization_config``
  (``from_config``) or, for a scheme that quantizes at load (``quantization="fp8"`` on a float
  checkpoint), from its name alone (``online``). ``get_quant_method(layer, prefix)`` says how one
  linear layer is quantized (None: it stays a plain linear).
- ``QuantizeMethodBase``: the per-layer hooks, called in this order on a ``Linear``:
  ``create_weights(layer)`` right after the model is built (replace or add parameters, each with a
  ``weight_loader``), the checkpoint (or dummy) load, ``process_weights_after_loading(layer)``
  (quantize, expand scales: the layer's final form), then ``apply(layer, x, bias)`` per forward.

The model code never sees either: ``quantization.apply.quantize_model`` hands each linear its method
after the model is built (``CustomOp.set_quant_method``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn


class QuantizeMethodBase(ABC):
    """How one layer's weights are stored and multiplied. Stateless across layers: one instance may
    serve many layers (the per-layer state lives in the layer's parameters)."""

    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Replace or add ``layer``'s parameters for this scheme (right after the model is built)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        """Turn the loaded parameters into their serving form (once, after the load)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T (+ bias)`` for ``x [..., in_features]`` with the layer's quantized weights."""


class QuantizationConfig(ABC):
    """One quantization scheme's settings. ``name`` is the ``quantization`` value (and the checkpoint
    ``quantization_config.quant_method``) that selects it."""

    name: ClassVar[str]
    # Our merged module name -> the checkpoint modules it stands for (set by ``quantize_model``).
    packed_modules_mapping: dict[str, list[str]]

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """The scheme of a checkpoint's ``quantization_config`` (ValueError naming the field it
        cannot serve)."""

    @classmethod
    def online(cls) -> QuantizationConfig:
        """The scheme applied at load to a float checkpoint; ValueError where the scheme needs a
        quantized checkpoint."""
        raise ValueError(f"quantization={cls.name!r} needs a checkpoint quantized with it (a config.json "
                         f"quantization_config with quant_method {cls.name!r}); this checkpoint has none")

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for the linear ``layer`` named ``prefix`` (our module name), or None (unquantized)."""

    def weight_iterator(self, source: Any) -> Any:
        """The checkpoint's (name, tensor) pairs as this scheme loads them (a
        ``loader.ModelSource``'s; a GGUF scheme asks for the packed blocks)."""
        return source.iter_weights()

    def describe(self) -> str:
        """One line for the start-up log."""
        return self.name
