"""compressed-tensors checkpoints (llm-compressor's format), FP8 schemes only.

config.json's ``quantization_config``: ``quant_method: "compressed-tensors"``, ``format``
("float-quantized" or "naive-quantized"), ``ignore`` (module names or ``re:`` patterns kept in
float) and ``config_groups``: one group targeting ``Linear`` with
``weights: {type: "float", num_bits: 8, strategy: "tensor" | "channel", symmetric: true, dynamic:
false}`` and ``input_activations`` None (weight-only) or ``{type: "float", num_bits: 8, strategy:
"token" | "tensor", dynamic: true | false}`` (static: per tensor, from ``input_scale``). Served by
``fp8.Fp8LinearMethod`` as they are. Anything else (int weights, block or group strategies, several
groups, other targets, sparse formats, a ``kv_cache_scheme``) is refused with a ValueError naming
the field.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.layers.linear import Linear
from pagedllm.quantization.base import QuantizationConfig, QuantizeMethodBase
from pagedllm.quantization.fp8 import Fp8LinearMethod, Fp8Scheme
from pagedllm.quantization.ignored import is_layer_skipped

_FIELD = "quantization: quantization_config"


def _check_fp8(args: dict[str, Any], where: str) -> None:
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise ValueError(f"{_FIELD}.{where}: only 8-bit float (FP8) is supported, got type={args.get('type')!r} "
                         f"num_bits={args.get('num_bits')!r}")
    if args.get("symmetric", True) is not True:
        raise ValueError(f"{_FIELD}.{where}.symmetric must be true for FP8")


def _weight_scheme(weights: dict[str, Any] | None) -> None:
    if not weights:
        raise ValueError(f"{_FIELD}.config_groups: a group without weights quantization is not supported")
    _check_fp8(weights, "weights")
    if weights.get("strategy") not in ("tensor", "channel") or weights.get("dynamic", False):
        raise ValueError(f"{_FIELD}.weights.strategy must be 'tensor' or 'channel' with static scales, "
                         f"got strategy={weights.get('strategy')!r} dynamic={weights.get('dynamic')!r}")


def _activation_scheme(acts: dict[str, Any] | None) -> str | None:
    if not acts:
        return None
    _check_fp8(acts, "input_activations")
    strategy, dynamic = acts.get("strategy"), acts.get("dynamic")
    if dynamic and strategy in ("token", "tensor"):
        return strategy
    if dynamic is False and strategy == "tensor":
        return "static"
    raise ValueError(f"{_FIELD}.input_activations: strategy={strategy!r} dynamic={dynamic!r} is not supported "
                     "(dynamic 'token' or 'tensor', or static 'tensor')")


class CompressedTensorsConfig(QuantizationConfig):
    """A compressed-tensors FP8 checkpoint (module doc); always serialized, never online."""

    name = "compressed-tensors"

    def __init__(self, scheme: Fp8Scheme, ignore: list[str]) -> None:
        self.scheme = scheme
        self.ignore = ignore
        self.packed_modules_mapping: dict[str, list[str]] = {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        groups = config.get("config_groups") or {}
        if len(groups) != 1:
            raise ValueError(f"{_FIELD}.config_groups: exactly one group is supported, got {len(groups)}")
        (group,) = groups.values()
        if "Linear" not in (group.get("targets") or []):
            raise ValueError(f"{_FIELD}.config_groups targets {group.get('targets')!r}: only 'Linear' is supported")
        _weight_scheme(group.get("weights"))
        activations = _activation_scheme(group.get("input_activations"))
        if config.get("kv_cache_scheme") is not None:
            raise ValueError(f"{_FIELD}.kv_cache_scheme: an FP8 KV cache from the checkpoint is not supported yet")
        sparsity = config.get("sparsity_config") or {}
        if sparsity.get("format", "dense") != "dense":
            raise ValueError(f"{_FIELD}.sparsity_config format {sparsity.get('format')!r} is not supported (dense only)")
        fmt = config.get("format", "float-quantized")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ValueError(f"{_FIELD}.format {fmt!r} is not supported (float-quantized, naive-quantized)")
        return cls(Fp8Scheme(serialized=True, activations=activations), list(config.get("ignore") or []))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not isinstance(layer, Linear) or is_layer_skipped(prefix, self.ignore, self.packed_modules_mapping):
            return None
        return Fp8LinearMethod(self.scheme)

    def describe(self) -> str:
        return f"compressed-tensors fp8 weights, activations: {self.scheme.activations or 'float (weight-only)'}"
