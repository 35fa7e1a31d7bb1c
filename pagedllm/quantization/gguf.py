"""GGUF weights kept in their blocks behind the linear, embedding and LM-head layers: ``quantization="gguf"``.

Which path a GGUF file takes (vLLM's rule: a GGUF model file implies ``quantization="gguf"``):

- ``quantization`` None or "gguf" with ``load_format`` "auto" or "gguf": the file's quantized
  matrices stay packed (``GGUFConfig``); norms and biases (F32 in the file) load as float.
- ``load_format="gguf_dequantized"``: every weight dequantized to float at load (the
  dequantized-float path: 32 bits a weight on the CPU, the exact reference of the packed path).
- another ``quantization`` (``fp8``) applies its own scheme to the dequantized weights.

Serving form of a layer (``GGUFLinearMethod`` for a ``Linear``, ``GGUFEmbeddingMethod`` for the
token embedding and the LM head): ``weight`` is a uint8 Parameter holding the packed rows of every
segment back to back, and ``weight.gguf_segments`` lists the ``GGUFSegment``s (runs of output rows
in one block format; a merged qkv or gate_up layer whose shards share a format is one segment).
A tied LM head shares the embedding's Parameter, so the packed table is held once.

Products: ``apply`` picks the kernel of the input's device from ``PACKED_KERNELS`` (the CPU: the C
library's ``gguf_matmul``, which decodes blocks in registers; a CUDA entry is the hook for the
Triton kernels). On the CPU the packed products equal the dequantized model's to float rounding;
opt-in (``PAGEDLLM_GGUF_INT8_ACTIVATIONS=1``, read at load), Q4_0 / Q4_1 / Q8_0 layers round the
activations to int8 blocks and take integer dot products (llama.cpp's scheme: the logits move by a
few percent of their largest value; faster from about 8 rows, not at batch 1 on the embedded model,
whose step is mostly outside the matmuls). Without it many rows at once (prefill)
dequantize a tile of weight rows exactly and run the float GEMM (``PREFILL_MIN_ROWS``). Where the
device has no kernel, or the CPU kernels cannot be built, ``process_weights_after_loading``
dequantizes the layer once (F32 segments, ``F.linear``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import envs
from pagedllm.layers.embedding import LMHead, VocabEmbedding
from pagedllm.layers.linear import Linear, MergedLinear
from pagedllm.loader.gguf_file import GGUFTensor
from pagedllm.native import kernels as native
from pagedllm.quantization.base import QuantizationConfig, QuantizeMethodBase

logger = logging.getLogger(__name__)

F32, F16 = 0, 1
# GGML type -> name, for the formats the CPU kernel multiplies packed (others are dequantized at load).
PACKED_TYPES = {F32: "F32", F16: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
# From this many rows of x on, a tile of weight rows is dequantized and multiplied by the float GEMM
# (the decode kernel re-decodes every block for each 4 rows; the GEMM reuses a tile for all rows).
PREFILL_MIN_ROWS = 128
TILE_WEIGHTS = 1 << 19  # weights per dequantized tile (2 MiB of float32)
LOAD_FORMATS = ("auto", "gguf", "gguf_dequantized")


@dataclass(frozen=True)
class GGUFSegment:
    """Output rows ``[row_start, row_start + num_rows)`` of a layer, stored as ``qtype`` blocks at
    byte ``byte_offset`` of the packed weight, ``row_bytes`` a row."""

    row_start: int
    num_rows: int
    qtype: int
    byte_offset: int
    row_bytes: int

    def rows(self, weight: torch.Tensor) -> torch.Tensor:
        """This segment's packed rows ``[num_rows, row_bytes]`` (a view of ``weight``)."""
        return weight.narrow(0, self.byte_offset, self.num_rows * self.row_bytes).view(self.num_rows, self.row_bytes)


def _mm_into(dst: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``dst = x @ w^T`` (``dst`` may be a column slice of a wider output)."""
    if dst.is_contiguous():
        torch.mm(x, w.t(), out=dst)
    else:
        dst.copy_(torch.mm(x, w.t()))


def _cpu_linear(x: torch.Tensor, packed: torch.Tensor, qtype: int, out: torch.Tensor,
                int8_activations: bool = False) -> None:
    """``out = x @ W^T`` on the CPU (``out`` a column slice of the layer's output). With
    ``int8_activations`` (and a kernel for ``qtype``) every batch takes the integer kernel, which
    beats dequantizing tiles for the float GEMM at every row count."""
    if int8_activations and native.gguf_q8_supported(qtype):
        native.gguf_matmul(x, packed, qtype, out, int8_activations=True)
        return
    if x.shape[0] < PREFILL_MIN_ROWS:
        native.gguf_matmul(x, packed, qtype, out)
        return
    tile = max(1, TILE_WEIGHTS // x.shape[1])
    for start in range(0, packed.shape[0], tile):
        rows = packed[start:start + tile]
        _mm_into(out[:, start:start + rows.shape[0]], x, native.gguf_dequantize_rows(rows, qtype, x.shape[1]))


_cpu_linear_int8 = functools.partial(_cpu_linear, int8_activations=True)

# The kernels per device type (the hook for other devices: add an entry to both tables).
# ``PACKED_KERNELS[d](x float32 [M, K], packed [N, row_bytes], qtype, out float32 [M, N] view)``;
# ``PACKED_GATHERS[d](packed, qtype, K, ids) -> float32 [len(ids), K]`` (the embedding lookup).
PACKED_KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], None]] = {"cpu": _cpu_linear}
PACKED_GATHERS: dict[str, Callable[[torch.Tensor, int, int, torch.Tensor], torch.Tensor]] = {
    "cpu": native.gguf_dequantize_gather}


def has_packed_kernel(device: torch.device) -> bool:
    """Whether ``device`` multiplies GGUF blocks packed (the CPU needs the C library built)."""
    if device.type == "cpu":
        return native.load() is not None
    return device.type in PACKED_KERNELS and device.type in PACKED_GATHERS


def as_gguf_tensor(loaded: GGUFTensor | torch.Tensor) -> GGUFTensor:
    """A checkpoint tensor as a ``GGUFTensor``: a float one (F32 in the file) becomes F32 rows."""
    if isinstance(loaded, GGUFTensor):
        return loaded
    if loaded.dim() != 2:
        raise ValueError(f"weight shape {tuple(loaded.shape)} is not a matrix")
    rows = loaded.detach().to("cpu", torch.float32).contiguous()
    return GGUFTensor(F32, tuple(rows.shape), rows.view(torch.uint8))


def dequantized(t: GGUFTensor) -> GGUFTensor:
    """``t`` as F32 rows (exactly dequantized)."""
    return t if t.qtype == F32 else as_gguf_tensor(t.dequantize())


def pack_segments(param: nn.Parameter, parts: list[GGUFTensor], keep_packed: bool) -> None:
    """Make ``param`` the serving form of ``parts`` (the layer's row blocks, in row order): their
    bytes back to back (on ``param``'s device) and ``param.gguf_segments``. Formats without a kernel,
    and every part where ``keep_packed`` is False, are dequantized first."""
    parts = [p if keep_packed and p.qtype in PACKED_TYPES else dequantized(p) for p in parts]
    segments, blobs, row, offset = [], [], 0, 0
    for p in parts:
        last = segments[-1] if segments else None
        if last is not None and last.qtype == p.qtype and last.row_bytes == p.data.shape[1]:
            segments[-1] = GGUFSegment(last.row_start, last.num_rows + p.shape[0], p.qtype, last.byte_offset,
                                       last.row_bytes)
        else:
            segments.append(GGUFSegment(row, p.shape[0], p.qtype, offset, p.data.shape[1]))
        blobs.append(p.data.reshape(-1))
        row += p.shape[0]
        offset += p.data.numel()
    param.data = torch.cat(blobs).to(param.device)
    param.gguf_segments = tuple(segments)
    param.gguf_rows = tuple(seg.rows(param.data) for seg in segments)  # views, made once
    param.gguf_int8_activations = envs.PAGEDLLM_GGUF_INT8_ACTIVATIONS  # read once, at load (CPU only)


def gguf_linear(weight: nn.Parameter, x: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for the packed ``weight`` (see the module doc); float32 inside, the
    result in ``x``'s dtype."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    xf = x2 if x2.dtype == torch.float32 and x2.stride(-1) == 1 else x2.float().contiguous()
    out = torch.empty((xf.shape[0], out_features), dtype=torch.float32, device=x.device)
    kernel = PACKED_KERNELS.get(x.device.type)
    if x.device.type == "cpu" and weight.gguf_int8_activations:
        kernel = _cpu_linear_int8
    whole = len(weight.gguf_segments) == 1
    for seg, rows in zip(weight.gguf_segments, weight.gguf_rows):
        cols = out if whole else out[:, seg.row_start:seg.row_start + seg.num_rows]
        if seg.qtype == F32:
            _mm_into(cols, xf, rows.view(torch.float32))
        else:
            kernel(xf, rows, seg.qtype, cols)
    if bias is not None:
        out += bias
    out = out if x.dtype == torch.float32 else out.to(x.dtype)
    return out.reshape(*x.shape[:-1], out_features)


class GGUFLinearMethod(QuantizeMethodBase):
    """A ``Linear`` whose weight stays in GGUF blocks (module doc). Each checkpoint shard (q, k, v;
    gate, up) arrives as a ``GGUFTensor`` and waits in ``layer.gguf_shards`` until
    ``process_weights_after_loading`` packs them into segments. Cost per call: one kernel per
    segment; the weight is read once."""

    def create_weights(self, layer: nn.Module) -> None:
        old = layer.weight
        param = nn.Parameter(torch.empty(0, dtype=torch.uint8, device=old.device), requires_grad=False)
        param.weight_loader = self._loader(layer)
        if hasattr(old, "shard_ids"):
            param.shard_ids = old.shard_ids
        layer.weight = param
        layer.gguf_shards = {}

    @staticmethod
    def _loader(layer: Linear):
        def load(param: nn.Parameter, loaded: GGUFTensor | torch.Tensor, shard_id: object = None) -> None:
            t = as_gguf_tensor(loaded)
            merged = isinstance(layer, MergedLinear) and shard_id is not None
            index = layer.shard_names.index(shard_id) if merged else 0
            rows = layer.checkpoint_sizes[index] if merged else layer.out_features
            if t.shape != (rows, layer.in_features):
                raise ValueError(f"weight shape {t.shape} does not match parameter {(rows, layer.in_features)}")
            layer.gguf_shards[index] = t

        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not layer.gguf_shards:  # dummy weights: nothing was loaded
            raise ValueError("quantization: gguf layers load their blocks from a GGUF file (load_format='dummy' "
                             "has none)")
        parts = [layer.gguf_shards[i] for i in sorted(layer.gguf_shards)]
        pack_segments(layer.weight, parts, has_packed_kernel(layer.weight.device))
        layer.gguf_shards = {}

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return gguf_linear(layer.weight, x, layer.out_features, bias)


class GGUFEmbeddingMethod(QuantizeMethodBase):
    """The token embedding (``embedding``: gather rows, dequantize them) and the LM head (``apply``)
    with their table in GGUF blocks. The checkpoint tensor is packed as it loads (one tensor, no
    shards); a tied head shares the embedding's Parameter and loads nothing itself."""

    def create_weights(self, layer: nn.Module) -> None:
        if getattr(layer, "tied", False):
            return  # the embedding's method turns the shared Parameter into its packed form
        param = layer.weight
        param.gguf_shape, param.gguf_dtype = tuple(param.shape), param.dtype
        param.data = torch.empty(0, dtype=torch.uint8, device=param.device)

        def load(p: nn.Parameter, loaded: GGUFTensor | torch.Tensor, shard_id: object = None) -> None:
            t = as_gguf_tensor(loaded)
            if t.shape != p.gguf_shape:
                raise ValueError(f"weight shape {t.shape} does not match parameter {p.gguf_shape}")
            pack_segments(p, [t], has_packed_kernel(p.device))

        param.weight_loader = load

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return gguf_linear(layer.weight, x, layer.weight.gguf_shape[0], bias)

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T] ids -> [T, hidden]`` rows of the table, dequantized, in the model dtype."""
        weight = layer.weight
        (seg,), (rows,) = weight.gguf_segments, weight.gguf_rows
        cols = weight.gguf_shape[1]
        if seg.qtype == F32:
            out = F.embedding(input_ids, rows.view(torch.float32))
        else:
            out = PACKED_GATHERS[input_ids.device.type](rows, seg.qtype, cols, input_ids)
        return out.to(weight.gguf_dtype)


class GGUFConfig(QuantizationConfig):
    """``quantization="gguf"``: a GGUF file's blocks stay packed in every linear layer, the token
    embedding and the LM head (module doc)."""

    name = "gguf"

    def __init__(self) -> None:
        self.packed_modules_mapping: dict[str, list[str]] = {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFConfig:
        return cls()

    @classmethod
    def online(cls) -> GGUFConfig:
        raise ValueError("quantization='gguf' needs a GGUF model file (a .gguf path, or a folder holding one)")

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, Linear):
            return GGUFLinearMethod()
        if isinstance(layer, (VocabEmbedding, LMHead)):
            return GGUFEmbeddingMethod()
        return None

    def weight_iterator(self, source: Any) -> Any:
        return source.iter_weights(gguf_packed=True)

    def describe(self) -> str:
        return ("gguf (the file's quantized blocks stay packed in the linear layers, embedding and LM head; "
                "load_format='gguf_dequantized' loads them as float instead)")


def gguf_quantization(quantization: str | None, source_kind: str | None, load_format: str) -> str | None:
    """The ``quantization`` a model is served with, given the GGUF rule (module doc): "gguf" for a GGUF
    file loaded from its blocks; ValueErrors name the field that contradicts the model."""
    is_gguf = source_kind == "gguf"
    if load_format in ("gguf", "gguf_dequantized") and not is_gguf:
        raise ValueError(f"load_format={load_format!r} needs a GGUF model file (a .gguf path, or a folder holding one)")
    if quantization == "gguf":
        if not is_gguf:
            raise ValueError("quantization='gguf' needs a GGUF model file (a .gguf path, or a folder holding one)")
        if load_format not in ("auto", "gguf"):
            raise ValueError(f"quantization='gguf' serves the file's packed blocks; load_format={load_format!r} "
                             "does not load them (use 'auto' or 'gguf')")
    if quantization is None and is_gguf and load_format in ("auto", "gguf"):
        return "gguf"
    return quantization
