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
- block-wise (an "fp8" config with ``weight_block_size: [bn, bk]``, as DeepSeek-V3 and Qwen3-FP8):
  ``weight_scale_inv [ceil(N / bn), ceil(K / bk)]`` multiplies each ``bn x bk`` block of the
  float8 weight; activations are quantized per token and group of ``bk`` columns. The product
  dequantizes both (``fp8_ops.fp8_linear_blockwise``, on every device: correct, not fast).

Serving form of a layer: ``weight [N, K]`` float8_e4m3fn (1 byte an element), ``weight_scale [N]``
float32 (or ``weight_scale_inv`` for block-wise), ``input_scale`` a float32 ``[1]`` (static
activations) or absent. ``apply`` multiplies through ``fp8_ops``: at decode rows on CUDA the Triton
weight-only GEMV (activations as they are, whatever the scheme: the product closer to the float
one); else it quantizes the activations (per token unless the scheme says per tensor or static;
none for weight-only schemes) and runs cuBLASLt on Hopper, or the tiled float32 product.
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
    "static" (the checkpoint's ``input_scale``), or None (weight-only: float activations).
    ``block``: ``(bn, bk)`` for block-wise weight scales (then activations per token and group)."""

    serialized: bool
    activations: str | None = "token"
    block: tuple[int, int] | None = None

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


def _block_scale_loader(layer: Linear, bn: int):
    """Loads a checkpoint ``weight_scale_inv`` (one row per ``bn`` weight rows) into the rows of its
    shard's blocks (``create_weights`` checked that every shard starts on a block)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None or not isinstance(layer, MergedLinear):
            default_weight_loader(param, loaded)
            return
        start, size = _shard_rows(layer, shard_id)
        default_weight_loader(param.narrow(0, start // bn, -(-size // bn)), loaded)

    return load


def _check_block_alignment(layer: Linear, bn: int) -> None:
    starts = layer.offsets[1:] if isinstance(layer, MergedLinear) else []
    if any(start % bn for start in starts):
        raise ValueError(f"quantization: quantization_config.weight_block_size [{bn}, ...] does not divide the "
                         f"merged projections of {layer.output_sizes} rows of a {type(layer).__name__}")


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
    """FP8 weights of one ``Linear`` (module doc). Cost per call: at decode rows on CUDA one GEMV
    launch (two with split K); at batch rows the ``fp8_ops.BATCH_GEMM`` (with the activation codes
    from the op before where the fused methods run); else one activation quantization pass (unless
    weight-only) and one FP8 GEMM; on the CPU a float32 tile of weight rows at a time. Fused methods
    (``Linear``'s): ``apply_norm_prologue``, ``apply_act_prologue``, ``apply_norm_qkv_rope_store``."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: nn.Module) -> None:
        if not self.scheme.serialized:
            return  # the float weight loads as usual; process_weights_after_loading quantizes it
        n, k = layer.weight.shape
        device = layer.weight.device
        _new_param(layer, "weight", torch.empty(n, k, dtype=fp8_ops.FP8_DTYPE, device=device), layer.weight_loader)
        if self.scheme.block is not None:
            bn, bk = self.scheme.block
            _check_block_alignment(layer, bn)
            _new_param(layer, "weight_scale_inv", torch.empty(-(-n // bn), -(-k // bk), dtype=torch.float32,
                                                              device=device), _block_scale_loader(layer, bn))
            return
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

    def apply_norm_prologue(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                            norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(apply(norm(x + residual)), x + residual)`` in one launch at decode rows (the GEMV's
        prologue), or two at batch rows with activation codes (norm + codes, then the GEMM:
        ``Linear.forward_norm_prologue``); None where neither applies (not CUDA, block-wise scales,
        a norm weight or residual unlike ``x``, a scheme without per-token codes at batch rows)."""
        if self.scheme.block is not None:
            return None
        kind = self._batch_codes_gemm(layer, x)
        if kind is not None:
            fused = fp8_ops.rms_norm_quant(x, residual, norm.weight, norm.eps)
            if fused is None:
                return None
            xq, x_scale, residual_out = fused
            return fp8_ops.batch_product(kind, xq, x_scale, layer.weight, layer.weight_scale, layer.bias,
                                         x.dtype), residual_out
        if not (fp8_ops.prologue_fits(x, layer.weight, layer.weight_scale, "norm")
                and norm.weight.dtype == x.dtype and norm.weight.is_contiguous()
                and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                          and residual.stride(-1) == 1))):
            return None
        return fp8_ops.rms_norm_fp8_gemv(x, residual, norm.weight, norm.eps, layer.weight, layer.weight_scale,
                                         layer.bias)

    def apply_act_prologue(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """``apply(silu(gate) * up)`` for ``x = [gate | up]`` in one launch at decode rows, two at batch
        rows with activation codes (``Linear.forward_act_prologue``), or None where neither applies."""
        if self.scheme.block is not None:
            return None
        if x.dim() == 2 and x.shape[-1] == 2 * layer.weight.shape[1]:
            kind = self._batch_codes_gemm(layer, x[:, : layer.weight.shape[1]])
            if kind is not None:
                codes = fp8_ops.silu_and_mul_quant(x)
                if codes is None:
                    return None
                return fp8_ops.batch_product(kind, *codes, layer.weight, layer.weight_scale, layer.bias, x.dtype)
        if not fp8_ops.prologue_fits(x, layer.weight, layer.weight_scale, "act"):
            return None
        return fp8_ops.silu_and_mul_fp8_gemv(x, layer.weight, layer.weight_scale, layer.bias)

    def apply_norm_qkv_rope_store(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                                  norm: nn.Module, positions: torch.Tensor, cos_cache: torch.Tensor,
                                  sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                                  slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``QKVLinear.forward_norm_rope_store`` for FP8 weights: residual add + RMSNorm + this qkv
        projection + RoPE + the K/V store of one token row in one launch, or None where that kernel
        does not apply (block-wise scales, not CUDA, shapes it does not take)."""
        if self.scheme.block is not None:
            return None
        return fp8_ops.norm_qkv_rope_store(x, residual, norm.weight, norm.eps, layer.weight, layer.weight_scale,
                                           layer.bias, positions, cos_cache, sin_cache, layer.num_heads,
                                           layer.num_kv_heads, kv_cache, slot_mapping)

    def _batch_codes_gemm(self, layer: nn.Module, x: torch.Tensor) -> str | None:
        """The batch GEMM (``fp8_ops.batch_gemm``) at ``x``'s rows for the dynamic per-token scheme
        (the codes it multiplies), else None."""
        if self.scheme.activations != "token":
            return None
        return fp8_ops.batch_gemm(x, layer.weight, layer.weight_scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        wq = layer.weight
        if self.scheme.block is not None:
            y = fp8_ops.fp8_linear_blockwise(x2, wq, layer.weight_scale_inv, self.scheme.block, x.dtype)
            return (y if bias is None else y + bias).reshape(*x.shape[:-1], wq.shape[0])
        w_scale = layer.weight_scale
        if fp8_ops.gemv_fits(x2, wq, w_scale):  # decode rows: weight-only, the bias inside
            return fp8_ops.fp8_gemv(x2, wq, w_scale, bias).reshape(*x.shape[:-1], wq.shape[0])
        kind = self._batch_codes_gemm(layer, x2)
        if kind is not None:  # batch rows: per-token codes, then the batch GEMM
            xq, x_scale = fp8_ops.quantize_activations(x2, None)
            y = fp8_ops.batch_product(kind, xq, x_scale, wq, w_scale, bias, x.dtype)
            return y.reshape(*x.shape[:-1], wq.shape[0])
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
    kept in float; ``weight_block_size`` ``[bn, bk]``: block-wise, dynamic activations only)."""

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
        act = config.get("activation_scheme", "dynamic")
        if act not in ("dynamic", "static"):
            raise ValueError(f"quantization: quantization_config.activation_scheme must be 'dynamic' or 'static', "
                             f"got {act!r}")
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or []
        block = config.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, (list, tuple)) and len(block) == 2
                    and all(type(b) is int and b > 0 for b in block)):
                raise ValueError(f"quantization: quantization_config.weight_block_size must be two positive "
                                 f"integers [block_n, block_k], got {block!r}")
            if act != "dynamic":
                raise ValueError("quantization: quantization_config.activation_scheme must be 'dynamic' with "
                                 "weight_block_size (block-wise FP8)")
            return cls(Fp8Scheme(serialized=True, activations="token", block=(block[0], block[1])), ignored)
        return cls(Fp8Scheme(serialized=True, activations="token" if act == "dynamic" else "static"), ignored)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not isinstance(layer, Linear) or is_layer_skipped(prefix, self.ignored_layers, self.packed_modules_mapping):
            return None
        return Fp8LinearMethod(self.scheme)

    def describe(self) -> str:
        source = "checkpoint" if self.scheme.serialized else "quantized at load, per output channel"
        if self.scheme.block is not None:
            source = f"checkpoint, {self.scheme.block[0]}x{self.scheme.block[1]} blocks"
        acts = "per token and group" if self.scheme.block else self.scheme.activations or "float (weight-only)"
        return f"fp8 weights ({source}), activations: {acts}"
