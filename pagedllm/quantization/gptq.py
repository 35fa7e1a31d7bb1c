"""GPTQ int4 checkpoints (AutoGPTQ / GPTQModel's format), served in the int4 form of ``int4.py``.

config.json's ``quantization_config``: ``quant_method: "gptq"``, ``bits`` (4), ``group_size`` (a
positive number of input rows, or -1: one group), ``desc_act`` (act-order: rows quantized in the
order of their activation magnitudes, so ``g_idx`` is no longer ``k // group_size``), ``sym``
(either: the zero points are stored), ``checkpoint_format`` ("gptq", or "gptq_v2" whose zero points
are stored as they are), ``lm_head`` (must be false), ``dynamic`` (per-module overrides: not
supported), ``modules_in_block_to_quantize`` (where given, the projections it does not name stay float).

Per quantized linear of ``K`` inputs, ``N`` outputs and ``G = ceil(K / group_size)`` groups:
``qweight`` int32 ``[K / 8, N]`` (packed along the input dim: nibble ``j`` of ``qweight[i, n]`` is
row ``8i + j``), ``qzeros`` int32 ``[G, N / 8]`` (packed along the output dim in order; format
"gptq" stores ``zero - 1``), ``scales`` float16 ``[G, N]``, ``g_idx`` int32 ``[K]`` (each input
row's group). ``W^T[k, n] = (q[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n]``. The merged
q/k/v and gate/up layers take each shard's columns; the shards share their input, so their
``g_idx`` must be equal (checked after the load).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagedllm.layers.linear import Linear, MergedLinear
from pagedllm.quantization import int4
from pagedllm.quantization.base import QuantizationConfig, QuantizeMethodBase
from pagedllm.quantization.ignored import is_layer_skipped

_FIELD = "quantization: quantization_config"
CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}  # format -> what the stored zero point lacks


def _quantized_modules(config: dict[str, Any]) -> list[str] | None:
    blocks = config.get("modules_in_block_to_quantize")
    if blocks is None:
        return None
    if not isinstance(blocks, list):
        raise ValueError(f"{_FIELD}.modules_in_block_to_quantize must be a list, got {blocks!r}")
    return [name for block in blocks for name in (block if isinstance(block, list) else [block])]


class GPTQLinearMethod(int4.Int4LinearMethod):
    """One GPTQ linear layer (module doc): created and loaded in the checkpoint's layout, then served
    in the int4 form (rows sorted by group where ``g_idx`` orders them otherwise)."""

    def __init__(self, group_size: int, zero_offset: int, desc_act: bool = False) -> None:
        super().__init__(group_size)
        self.zero_offset = zero_offset
        self.desc_act = desc_act  # only dummy weights read it: g_idx says the order of a checkpoint

    def create_weights(self, layer: nn.Module) -> None:
        self.check_layer(layer, "gptq")
        k, n, groups = layer.in_features, layer.out_features, self.num_groups(layer)
        shard_ids, device = self.take_weight(layer)
        num_shards = len(layer.output_sizes) if isinstance(layer, MergedLinear) else 1
        new = int4.new_param
        new(layer, "qweight", torch.empty(k // int4.PACK, n, dtype=torch.int32, device=device),
            int4.output_dim_loader(layer, 1, 1), shard_ids)
        new(layer, "qzeros", torch.empty(groups, n // int4.PACK, dtype=torch.int32, device=device),
            int4.output_dim_loader(layer, 1, int4.PACK), shard_ids)
        new(layer, "scales", torch.empty(groups, n, dtype=torch.float16, device=device),
            int4.output_dim_loader(layer, 1, 1), shard_ids)
        new(layer, "g_idx", torch.empty(num_shards, k, dtype=torch.int32, device=device),
            _g_idx_loader(layer), shard_ids)

    def to_serving_form(self, layer: nn.Module):
        g_idx = layer.g_idx.data
        if not bool((g_idx == g_idx[:1]).all()):
            raise ValueError(f"quantization: the merged projections of a {type(layer).__name__} have different "
                             "g_idx (act-order permutations); they must share one")
        zeros = int4.unpack_cols(layer.qzeros.data) + self.zero_offset
        try:
            perm = int4.group_order(g_idx[0], self.layer_group_size(layer), self.num_groups(layer))
        except ValueError as e:
            raise ValueError(f"quantization: {e}") from e
        q = int4.unpack_rows(layer.qweight.data).t()
        if perm is not None:
            q = q.index_select(1, perm)
        return q, layer.scales.data.t(), zeros.t(), perm

    def init_dummy_weights(self, layer: nn.Module, generator: torch.Generator, std: float) -> None:
        device = layer.qweight.device
        layer.qweight.data.copy_(int4.random_words(tuple(layer.qweight.shape), generator, device))
        layer.qzeros.data.copy_(int4.packed_constant(8 - self.zero_offset, tuple(layer.qzeros.shape), device))
        layer.scales.data.fill_(std / int4.DUMMY_SPREAD)
        groups = torch.arange(layer.in_features, device=device) // self.layer_group_size(layer)
        if self.desc_act:  # columns assigned to groups in a random order, one order for all shards
            order = torch.randperm(layer.in_features, generator=generator, device=device)
            groups = torch.empty_like(groups).scatter_(0, order, groups)
        layer.g_idx.data.copy_(groups.expand_as(layer.g_idx))


def _g_idx_loader(layer: Linear):
    """``g_idx [shards, K]``: each shard's row (a merged checkpoint tensor, or a plain layer, fills all)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.shape != (param.shape[1],):
            raise ValueError(f"g_idx shape {tuple(loaded.shape)} does not match {param.shape[1]} input rows")
        with torch.no_grad():
            if shard_id is None or not isinstance(layer, MergedLinear):
                param.copy_(loaded.expand_as(param))
            else:
                param[layer.shard_names.index(shard_id)].copy_(loaded)

    return load


class GPTQConfig(QuantizationConfig):
    """A GPTQ checkpoint's settings (module doc); always serialized, never online."""

    name = "gptq"

    def __init__(self, group_size: int, desc_act: bool, zero_offset: int,
                 quantized_modules: list[str] | None = None) -> None:
        self.group_size = group_size
        self.desc_act = desc_act
        self.zero_offset = zero_offset
        self.quantized_modules = quantized_modules
        self.packed_modules_mapping: dict[str, list[str]] = {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        int4.read_bits(config, "bits")
        group_size = int4.read_group_size(config, "group_size")
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in CHECKPOINT_FORMATS:
            raise ValueError(f"{_FIELD}.checkpoint_format {fmt!r} is not supported ({sorted(CHECKPOINT_FORMATS)})")
        if config.get("lm_head", False):
            raise ValueError(f"{_FIELD}.lm_head: a quantized lm_head is not supported")
        if config.get("dynamic"):
            raise ValueError(f"{_FIELD}.dynamic: per-module overrides are not supported")
        for key in ("desc_act", "sym"):
            if not isinstance(config.get(key, False), bool):
                raise ValueError(f"{_FIELD}.{key} must be true or false, got {config.get(key)!r}")
        return cls(group_size, bool(config.get("desc_act", False)), CHECKPOINT_FORMATS[fmt], _quantized_modules(config))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not isinstance(layer, Linear):
            return None
        if self.quantized_modules is not None and is_layer_skipped(
                prefix, [_not_ending_with(self.quantized_modules)], self.packed_modules_mapping):
            return None
        return GPTQLinearMethod(self.group_size, self.zero_offset, self.desc_act)

    def describe(self) -> str:
        order = ", act-order" if self.desc_act else ""
        return f"gptq int4 weights (group size {self.group_size}{order})"


def _not_ending_with(names: list[str]) -> str:
    """An ignore-list entry (``re:`` pattern) matching every module name that ends with none of
    ``names`` (``modules_in_block_to_quantize`` names the quantized ones)."""
    return "re:^(?!.*(" + "|".join(re.escape(n) for n in names) + ")$)"
