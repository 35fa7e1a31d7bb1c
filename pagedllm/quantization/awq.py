"""AWQ int4 checkpoints (AutoAWQ's GEMM format), served in the int4 form of ``int4.py``.

config.json's ``quantization_config``: ``quant_method: "awq"``, ``bits`` (or ``w_bit``; 4),
``group_size`` (or ``q_group_size``; positive, or -1: one group), ``zero_point`` (must be true: the
zero points are stored), ``version`` ("gemm"; the "gemv" layouts are not supported),
``modules_to_not_convert`` (modules kept in float: those whose name contains an entry, as vLLM reads it).

Per quantized linear of ``K`` inputs, ``N`` outputs and ``G = ceil(K / group_size)`` groups:
``qweight`` int32 ``[K, N / 8]`` and ``qzeros`` int32 ``[G, N / 8]``, both packed along the output
dim in AWQ's interleaved order (nibble ``i`` of a word holds column ``8c + (0, 2, 4, 6, 1, 3, 5,
7)[i]``), ``scales`` float16 ``[G, N]``; ``W^T[k, n] = (q[k, n] - zero[k // group_size, n]) *
scales[k // group_size, n]``. The merged q/k/v and gate/up layers take each shard's columns.
After the load the codes are repacked along the input dim (the serving form).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagedllm.layers.linear import Linear
from pagedllm.quantization import int4
from pagedllm.quantization.base import QuantizationConfig, QuantizeMethodBase
from pagedllm.quantization.ignored import is_layer_skipped

_FIELD = "quantization: quantization_config"


class AWQLinearMethod(int4.Int4LinearMethod):
    """One AWQ linear layer (module doc): created and loaded in the checkpoint's layout, then served
    in the int4 form."""

    def create_weights(self, layer: nn.Module) -> None:
        self.check_layer(layer, "awq")
        k, n, groups = layer.in_features, layer.out_features, self.num_groups(layer)
        shard_ids, device = self.take_weight(layer)
        packed_cols = int4.output_dim_loader(layer, 1, int4.PACK)
        int4.new_param(layer, "qweight", torch.empty(k, n // int4.PACK, dtype=torch.int32, device=device),
                       packed_cols, shard_ids)
        int4.new_param(layer, "qzeros", torch.empty(groups, n // int4.PACK, dtype=torch.int32, device=device),
                       packed_cols, shard_ids)
        int4.new_param(layer, "scales", torch.empty(groups, n, dtype=torch.float16, device=device),
                       int4.output_dim_loader(layer, 1, 1), shard_ids)

    def to_serving_form(self, layer: nn.Module):
        q = int4.unpack_cols(layer.qweight.data, int4.AWQ_ORDER).t()
        zeros = int4.unpack_cols(layer.qzeros.data, int4.AWQ_ORDER).t()
        return q, layer.scales.data.t(), zeros, None

    def init_dummy_weights(self, layer: nn.Module, generator: torch.Generator, std: float) -> None:
        device = layer.qweight.device
        layer.qweight.data.copy_(int4.random_words(tuple(layer.qweight.shape), generator, device))
        layer.qzeros.data.copy_(int4.packed_constant(8, tuple(layer.qzeros.shape), device))
        layer.scales.data.fill_(std / int4.DUMMY_SPREAD)


class AWQConfig(QuantizationConfig):
    """An AWQ checkpoint's settings (module doc); always serialized, never online."""

    name = "awq"

    def __init__(self, group_size: int, modules_to_not_convert: list[str] | None = None) -> None:
        self.group_size = group_size
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        # As ignore-list patterns: a module is kept in float when its name contains an entry.
        self.ignored = [f"re:.*{re.escape(name)}" for name in self.modules_to_not_convert]
        self.packed_modules_mapping: dict[str, list[str]] = {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        int4.read_bits(config, "bits", "w_bit")
        group_size = int4.read_group_size(config, "group_size", "q_group_size")
        if config.get("zero_point", True) is not True:
            raise ValueError(f"{_FIELD}.zero_point must be true (AWQ without zero points is not supported)")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{_FIELD}.version {config.get('version')!r} is not supported (only 'gemm')")
        return cls(group_size, config.get("modules_to_not_convert"))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not isinstance(layer, Linear) or is_layer_skipped(prefix, self.ignored, self.packed_modules_mapping):
            return None
        return AWQLinearMethod(self.group_size)

    def describe(self) -> str:
        return f"awq int4 weights (group size {self.group_size})"
