"""FP8 weights (float8_e4m3fn) behind the linear layer: ``quantization="fp8"`` and FP8 checkpoints.

Two sources, one serving form (``Fp8LinearMethod``):

- online (``quantization="fp8"`` on a float checkpoint): the layer loads its float weight as usual;
  ``process_weights_after_loading`` quantizes it per output channel (``fp8_ops.quantize_rows``).
- serialized (a checkpoint whose config.json has ``quantization_config`` with ``quant_method``
  "fp8", vLLM's and HF's format, or "compressed-tensors" with float8 weights): the float8 weight and
  its ``weight_scale`` (one per tensor, or one per output channel) load as they are, no
  re-quantization. A merged layer (qkv, gate_up) whose shards came with per-tensor scales keeps one
  scale per row, each row its shard's: exact, where vLLM re-quantizes to the largest. A static
  ``input_scale`` (one per shard) becomes the largest of them (as vLLM).

Serving form of a layer: ``weight [N, K]`` float8_e4m3fn (1 byte an element), ``weight_scale [N]``
float32, ``input_scale`` a float32 ``[1]`` (static activations) or absent. ``apply`` quantizes the
activations (per token unless the scheme says per tensor or static; none for weight-only schemes)
and multiplies through ``fp8_ops`` (cuBLASLt on Hopper, else the tiled float32 product).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.layers.linear import Linear, MergedLinear, RowParallelLinear, default_weight_loader
from pagedllm.quantization import fp8_ops
from pagedllm.quantization.base import QuantizationConfig, QuantizeMethodBase
from pagedllm.quantization.ignored import is_layer_skipped

ACTIVATION_SCHEMES = ("token", "tensor", "static", None)


@dataclass(frozen=True)
class Fp8Scheme:
    """``serialized``: the checkpoint's weights are float8 already (else quantized at load).
    ``activations``: "token" (dynamic, one scale per row), "tensor" (dynamic, one scale per call),
    "static" (the checkpoint's ``input_scale``), or None (weight-only: float activations)."""

    serialized: bool
    activations: str | None = "token"

    def __post_init__(self) -> None:
        if self.activations not in ACTIVATION_SCHEMES:
            raise ValueError(f"activations must be one of {ACTIVATION_SCHEMES}, got {self.activations!r}")


def _shard_rows(layer: Linear, shard_id: object) -> tuple[int, int]:
    """(first local row, number of rows) of ``shard_id`` in ``layer``'s weight (all rows for None)."""
    if shard_id is None or not isinstance(layer, MergedLinear):
        return 0, layer.out_features
    i = layer.shard_names.index(shard_id)
    return layer.offsets[i], layer.output_sizes[i]


def _weight_scale_loader(layer: Linear):
    """Loads a checkpoint ``weight_scale`` into the per-row ``[N]`` parameter: a single value fills
    the rows of its shard (per-tensor), a vector (``[rows]`` or ``[rows, 1]``) loads like the
    weight's rows (per-channel)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.numel() == 1:
            start, size = _shard_rows(layer, shard_id)
            with torch.no_grad():
                param.narrow(0, start, size).copy_(loaded.reshape(1).expand(size))
        elif isinstance(layer, RowParallelLinear):  # output rows are not split across ranks
            default_weight_loader(param, loaded.reshape(-1))
        else:
            layer.weight_loader(param, loaded.reshape(-1), shard_id)

    return load


def _max_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """A per-tensor ``input_scale``: the layer keeps the largest of its shards' (starts at 0)."""
    if loaded.numel() != 1:
        raise ValueError(f"input_scale shape {tuple(loaded.shape)} is not a single (per-tensor) scale")
    with torch.no_grad():
        param.copy_(torch.maximum(param, loaded.reshape(1).to(param)))


def _new_param(layer: Linear, name: str, tensor: torch.Tensor, loader: Any) -> None:
    """Register ``tensor`` as ``layer.<name>`` with its loader and the weight's shard ids (so the
    model reports a missing shard's scale as it reports a missing weight)."""
    param = nn.Parameter(tensor, requires_grad=False)
    param.weight_loader = loader
    shard_ids = getattr(layer.weight, "shard_ids", None)
    if shard_ids is not None:
        param.shard_ids = shard_ids
    setattr(layer, name, param)


class Fp8LinearMethod(QuantizeMethodBase):
    """FP8 weights of one ``Linear`` (module doc). Cost per call: one activation quantization pass
    (unless weight-only) and one FP8 GEMM; on the CPU a float32 tile of weight rows at a time."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: nn.Module) -> None:
        if not self.scheme.serialized:
            return  # the float weight loads as usual; process_weights_after_loading quantizes it
        n, k = layer.weight.shape
        device = layer.weight.device
        _new_param(layer, "weight", torch.empty(n, k, dtype=fp8_ops.FP8_DTYPE, device=device), layer.weight_loader)
        _new_param(layer, "weight_scale", torch.empty(n, dtype=torch.float32, device=device),
                   _weight_scale_loader(layer))
        if self.scheme.activations == "static":
            _new_param(layer, "input_scale", torch.zeros(1, dtype=torch.float32, device=device), _max_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.scheme.serialized:
            return
        wq, scale = fp8_ops.quantize_rows(layer.weight.data)
        layer.weight = nn.Parameter(wq, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        wq, w_scale = layer.weight, layer.weight_scale
        if self.scheme.activations is None:
            y = fp8_ops.fp8_linear_tiled(x2, None, wq, w_scale, x.dtype)
        else:
            static = getattr(layer, "input_scale", None) if self.scheme.activations == "static" else None
            xq, x_scale = fp8_ops.quantize_activations(x2, static, per_token=self.scheme.activations == "token")
            if fp8_ops.scaled_mm_fits(x2, wq):
                y = fp8_ops.fp8_linear_scaled_mm(xq, x_scale, wq, w_scale, x.dtype)
            else:
                y = fp8_ops.fp8_linear_tiled(xq, x_scale, wq, w_scale, x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], wq.shape[0])


class Fp8Config(QuantizationConfig):
    """``quantization="fp8"``: online (float checkpoint) or a checkpoint's ``quant_method: "fp8"``
    config (``activation_scheme`` "dynamic" | "static"; ``ignored_layers`` / ``modules_to_not_convert``
    kept in float). Block-wise checkpoints (``weight_block_size``) are refused."""

    name = "fp8"

    def __init__(self, scheme: Fp8Scheme, ignored_layers: list[str] | tuple[str, ...] = ()) -> None:
        self.scheme = scheme
        self.ignored_layers = list(ignored_layers)
        self.packed_modules_mapping: dict[str, list[str]] = {}

    @classmethod
    def online(cls) -> Fp8Config:
        return cls(Fp8Scheme(serialized=False, activations="token"))

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        if config.get("weight_block_size") is not None:
            raise ValueError(f"quantization: quantization_config.weight_block_size={config['weight_block_size']!r} "
                             "(block-wise FP8) is not supported yet; per-tensor and per-channel FP8 are")
        act = config.get("activation_scheme", "dynamic")
        if act not in ("dynamic", "static"):
            raise ValueError(f"quantization: quantization_config.activation_scheme must be 'dynamic' or 'static', "
                             f"got {act!r}")
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or []
        return cls(Fp8Scheme(serialized=True, activations="token" if act == "dynamic" else "static"), ignored)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not isinstance(layer, Linear) or is_layer_skipped(prefix, self.ignored_layers, self.packed_modules_mapping):
            return None
        return Fp8LinearMethod(self.scheme)

    def describe(self) -> str:
        source = "checkpoint" if self.scheme.serialized else "quantized at load, per output channel"
        return f"fp8 weights ({source}), activations: {self.scheme.activations or 'float (weight-only)'}"
