"""GGUF weights kept in their blocks behind the linear, embedding and LM-head layers: ``quantization="gguf"``.

Which path a GGUF file takes (vLLM's rule: a GGUF model file implies ``quantization="gguf"``):

- ``quantization`` None or "gguf" with ``load_format`` "auto" or "gguf": the file's quantized
  matrices stay packed (``GGUFConfig``); norms and biases (F32 in the file) load as float. On a GPU
  they stay packed only with ``quantization="gguf"`` given explicitly (``keeps_packed``); implied
  by the file, they are dequantized into the model dtype at load (faster there).
- ``load_format="gguf_dequantized"``: every weight dequantized to float at load (the
  dequantized-float path: 32 bits a weight on the CPU, the exact reference of the packed path).
- another ``quantization`` (``fp8``) applies its own scheme to the dequantized weights.

Serving form of a layer (``GGUFLinearMethod`` for a ``Linear``, ``GGUFEmbeddingMethod`` for the
token embedding and the LM head): ``weight`` is a uint8 Parameter holding the packed rows of every
segment back to back, and ``weight.gguf_segments`` lists the ``GGUFSegment``s (runs of output rows
in one block format; a merged qkv or gate_up layer whose shards share a format is one segment).
A tied LM head shares the embedding's Parameter, so the packed table is held once.

Products: ``apply`` picks the kernel of the input's device from ``PACKED_KERNELS`` (the CPU: the C
library's ``gguf_matmul``, which decodes blocks in registers, and from ``PREFILL_MIN_ROWS`` rows a
tile of weight rows dequantized exactly for the float GEMM; CUDA: the Triton GEMV / tiled GEMM of
``kernels/gguf_gemm.py`` on bf16 / fp16 activations, captured in the CUDA graphs). Below
``PREFILL_MIN_ROWS`` rows on the CPU a layer goes straight to ``native.gguf_matmul_segments`` with
the arguments made at load (``weight.gguf_cpu_segments``): at batch 1 the embedded model's step
is as much Python as product, so every call's overhead counts. Under the engine's CPU kernel plan
the linear layer's norm and activation prologues (``apply_norm_prologue``, ``apply_act_prologue``)
run the C RMSNorm / SiLU straight into that product, skipping the norm and activation modules. On the CPU the
packed products equal the dequantized model's to float rounding; opt-in
(``PAGEDLLM_GGUF_INT8_ACTIVATIONS=1``, read at load), Q4_0 / Q4_1 / Q8_0 layers round the
activations to int8 blocks and take integer dot products (llama.cpp's scheme: the logits move by a
few percent of their largest value; faster from about 8 rows, not at batch 1 on the embedded model,
whose step is mostly outside the matmuls). Where the device has no kernel (or, on CUDA, a layer has
a part in a format the Triton kernels lack), or the CPU kernels cannot be built,
``process_weights_after_loading`` dequantizes the layer once into one matrix of the model's dtype
and hands it back as a plain float layer (``as_float_layer``: no quantization method), which
``prepare_model_kernels`` then dispatches as a float checkpoint's layer, fused kernels and GEMM
choice included: the same kernels at 1 row as at the few rows of a speculative verification, and
no float32 copies of the activations.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import envs
from pagedllm.layers.embedding import LMHead, VocabEmbedding
from pagedllm.layers.linear import ColumnParallelLinear, Linear, MergedLinear, RowParallelLinear
from pagedllm.loader.gguf_file import GGUFSlice, GGUFTensor
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

def _cuda_linear(x: torch.Tensor, packed: torch.Tensor, qtype: int, out: torch.Tensor) -> None:
    """``out = x @ W^T`` on CUDA: the Triton GEMV / tiled GEMM, reading x and writing ``out`` in
    their own dtype (bf16 / fp16 in and out, float32 inside)."""
    from pagedllm.quantization.kernels import gguf_gemm

    gguf_gemm.gguf_linear(x, packed, CUDA_TYPES[qtype], out=out)


def _cuda_gather(packed: torch.Tensor, qtype: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    from pagedllm.quantization.kernels import gguf_gemm

    return gguf_gemm.gguf_gather(packed, CUDA_TYPES[qtype], k, ids)


# GGML type -> name, for the formats the CUDA kernels (kernels/gguf_gemm.py) multiply packed. A GPU
# layer with a part in another format is dequantized whole (no float32 rows beside bf16 activations).
CUDA_TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
# The kernels per device type (the hook for other devices: add an entry to both tables).
# ``PACKED_KERNELS[d](x [M, K], packed [N, row_bytes], qtype, out [M, N] view)`` (float32 on the CPU,
# x's dtype on CUDA); ``PACKED_GATHERS[d](packed, qtype, K, ids) -> float32 [len(ids), K]`` (the
# embedding lookup).
PACKED_KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], None]] = {
    "cpu": _cpu_linear, "cuda": _cuda_linear}
PACKED_GATHERS: dict[str, Callable[[torch.Tensor, int, int, torch.Tensor], torch.Tensor]] = {
    "cpu": native.gguf_dequantize_gather, "cuda": _cuda_gather}


def has_packed_kernel(device: torch.device) -> bool:
    """Whether ``device`` multiplies GGUF blocks packed (the CPU needs the C library built, CUDA
    needs Triton)."""
    if device.type == "cpu":
        return native.load() is not None
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None
    return device.type in PACKED_KERNELS and device.type in PACKED_GATHERS


def keeps_packed(device: torch.device, packed_on_gpu: bool) -> bool:
    """Whether a layer on ``device`` keeps its blocks: where the device has a kernel, and on CUDA only
    when asked (``quantization="gguf"`` given explicitly): the Triton kernels there save memory
    (about 4.5 bits a weight for Q4_1) but are slower than the model dtype's GEMMs."""
    return has_packed_kernel(device) and (device.type != "cuda" or packed_on_gpu)


def as_gguf_tensor(loaded: GGUFTensor | GGUFSlice | torch.Tensor) -> GGUFTensor:
    """A checkpoint tensor as a ``GGUFTensor``: a float one (F32 in the file) becomes F32 rows; a
    ``GGUFSlice`` not narrowed is read whole."""
    if isinstance(loaded, GGUFSlice):
        loaded = loaded.materialize()
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
    bytes back to back (on ``param``'s device) and ``param.gguf_segments``. With ``keep_packed``,
    formats without a kernel are dequantized to F32 rows; without it the whole layer is one matrix
    in ``param.gguf_dtype`` (``param.gguf_dense``, for ``as_float_layer``)."""
    if param.device.type == "cuda" and any(p.qtype not in CUDA_TYPES for p in parts):
        keep_packed = False
    if not keep_packed:
        _pack_dense(param, parts)
        return
    parts = [p if p.qtype in PACKED_TYPES else dequantized(p) for p in parts]
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
    # The CPU decode path's arguments (native.gguf_matmul_segments), where no segment is F32 rows.
    param.gguf_cpu_segments = None
    if param.device.type == "cpu" and all(seg.qtype != F32 for seg in segments):
        param.gguf_cpu_segments = tuple((seg.qtype, rows, seg.row_start)
                                        for seg, rows in zip(segments, param.gguf_rows))
    param.gguf_dense = None


def _pack_dense(param: nn.Parameter, parts: list[GGUFTensor]) -> None:
    """``parts`` dequantized exactly (float32), then rounded once to ``param.gguf_dtype``."""
    dense = torch.cat([dequantized(p).data.view(torch.float32) for p in parts])
    param.data = torch.empty(0, dtype=torch.uint8, device=param.device)
    param.gguf_segments = param.gguf_rows = ()
    param.gguf_cpu_segments = None
    param.gguf_dense = dense.to(param.device, param.gguf_dtype)


def as_float_layer(layer: nn.Module) -> None:
    """Where ``layer``'s weight was dequantized at load (``weight.gguf_dense``), make it the plain
    float layer of that matrix: no quantization method, the layer class's kernel flags, its
    implementation chosen again by ``prepare_model_kernels`` (``native`` until then). The
    Parameter object is kept (a tied LM head shares it with the embedding)."""
    weight = layer.weight
    if getattr(weight, "gguf_dense", None) is None:
        return
    weight.data = weight.gguf_dense
    layer.quant_method = None
    for flag in ("fuses_kernels", "gemm_tunable"):  # set on the instance by set_quant_method
        layer.__dict__.pop(flag, None)
    layer.use_impl("native")


def gguf_linear(weight: nn.Parameter, x: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for the packed ``weight`` (see the module doc); float32 inside, the
    result in ``x``'s dtype. The CPU kernels take float32 x; the CUDA ones x as it is."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    fast = getattr(weight, "gguf_cpu_segments", None)
    if (fast is not None and x2.shape[0] < PREFILL_MIN_ROWS and x2.dtype == torch.float32 and x2.is_cpu
            and x2.stride(-1) == 1 and not weight.gguf_int8_activations):
        # The CPU decode path (one C call per segment): what the loop below does, with less Python.
        out = torch.empty((x2.shape[0], out_features), dtype=torch.float32)
        native.gguf_matmul_segments(x2, fast, out)
        if bias is not None:
            out += bias
        return out.reshape(*x.shape[:-1], out_features)
    if x.is_cuda:  # every segment is a Triton-packed one there (pack_segments)
        xf = x2 if x2.stride(-1) == 1 else x2.contiguous()
    else:
        xf = x2 if x2.dtype == torch.float32 and x2.stride(-1) == 1 else x2.float().contiguous()
    out = torch.empty((xf.shape[0], out_features), dtype=xf.dtype, device=x.device)
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
    out = out if out.dtype == x.dtype else out.to(x.dtype)
    return out.reshape(*x.shape[:-1], out_features)


def _check_shape(loaded: GGUFTensor | GGUFSlice | torch.Tensor, expected: tuple[int, int]) -> None:
    """A checkpoint matrix must have the whole layer's shape (before any rank takes its slice)."""
    if tuple(loaded.shape) != expected:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter {expected}")


class GGUFLinearMethod(QuantizeMethodBase):
    """A ``Linear`` whose weight stays in GGUF blocks (module doc). Each checkpoint shard (q, k, v;
    gate, up) arrives as a ``GGUFTensor`` (under tensor parallelism a ``GGUFSlice``, of which this
    rank reads its ``checkpoint_slice`` only) and waits in ``layer.gguf_shards`` until
    ``process_weights_after_loading`` packs them into segments. Cost per call: one kernel per
    segment; the weight is read once."""

    def __init__(self, packed_on_gpu: bool = False) -> None:
        self.packed_on_gpu = packed_on_gpu

    def create_weights(self, layer: nn.Module) -> None:
        old = layer.weight
        param = nn.Parameter(torch.empty(0, dtype=torch.uint8, device=old.device), requires_grad=False)
        param.gguf_dtype = old.dtype  # the model's: the dtype of a layer dequantized at load
        param.weight_loader = self._loader(layer)
        if hasattr(old, "shard_ids"):
            param.shard_ids = old.shard_ids
        layer.weight = param
        layer.gguf_shards = {}

    @staticmethod
    def _loader(layer: Linear):
        """Checks a checkpoint matrix against the layer's whole (all ranks') shape, then keeps this
        rank's slice of it (``layer.checkpoint_slice``: a ``GGUFSlice`` reads only those blocks)."""
        tp_size = getattr(getattr(layer, "tp", None), "size", 1)
        whole_out = layer.out_features * (tp_size if isinstance(layer, ColumnParallelLinear) else 1)
        whole_in = layer.in_features * (tp_size if isinstance(layer, RowParallelLinear) else 1)

        def load(param: nn.Parameter, loaded: GGUFTensor | GGUFSlice | torch.Tensor, shard_id: object = None) -> None:
            if isinstance(layer, MergedLinear) and shard_id is None:  # the file stores the merged matrix
                expected = (sum(layer.checkpoint_sizes), whole_in)
                _check_shape(loaded, expected)
                start = 0
                for name, rows in zip(layer.shard_names, layer.checkpoint_sizes):
                    load(param, loaded.narrow(0, start, rows), name)
                    start += rows
                return
            merged = isinstance(layer, MergedLinear)
            index = layer.shard_names.index(shard_id) if merged else 0
            rows = layer.checkpoint_sizes[index] if merged else whole_out
            _check_shape(loaded, (rows, whole_in))
            layer.gguf_shards[index] = as_gguf_tensor(layer.checkpoint_slice(loaded, shard_id))

        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not layer.gguf_shards:  # dummy weights: nothing was loaded
            raise ValueError("quantization: gguf layers load their blocks from a GGUF file (load_format='dummy' "
                             "has none)")
        parts = [layer.gguf_shards[i] for i in sorted(layer.gguf_shards)]
        pack_segments(layer.weight, parts, keeps_packed(layer.weight.device, self.packed_on_gpu))
        layer.gguf_shards = {}
        as_float_layer(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return gguf_linear(layer.weight, x, layer.out_features, bias)

    def apply_norm_prologue(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                            norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(apply(norm(x + residual)), x + residual)`` (``Linear.forward_norm_prologue``) on the CPU:
        the C RMSNorm (with the add) straight into the packed product, without the norm module's
        dispatch (two C calls). None elsewhere (no GGUF prologue kernel on CUDA) or where the C norm
        does not take the inputs (not 2-D float32)."""
        if x.dim() != 2 or not native.applies(x, norm.weight, *(() if residual is None else (residual,))):
            return None
        if residual is None:
            normed, summed = native.rms_norm(x, norm.weight, norm.eps), x
        else:
            normed, summed = native.rms_norm(x, norm.weight, norm.eps, residual)
        return gguf_linear(layer.weight, normed, layer.out_features, layer.bias), summed

    def apply_act_prologue(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """``apply(silu(gate) * up)`` for ``x = [gate | up]`` (``Linear.forward_act_prologue``) on the
        CPU: the C activation straight into the packed product; None where it does not apply (as
        ``apply_norm_prologue``)."""
        if x.dim() != 2 or x.shape[-1] % 2 or not native.applies(x):
            return None
        return gguf_linear(layer.weight, native.silu_and_mul(x), layer.out_features, layer.bias)


class GGUFEmbeddingMethod(QuantizeMethodBase):
    """The token embedding (``embedding``: gather rows, dequantize them) and the LM head (``apply``)
    with their table in GGUF blocks. The checkpoint tensor is packed as it loads (one tensor, no
    shards); a tied head shares the embedding's Parameter and loads nothing itself."""

    def __init__(self, packed_on_gpu: bool = False) -> None:
        self.packed_on_gpu = packed_on_gpu

    def create_weights(self, layer: nn.Module) -> None:
        if getattr(layer, "tied", False):
            return  # the embedding's method turns the shared Parameter into its packed form
        param = layer.weight
        param.gguf_shape, param.gguf_dtype = tuple(param.shape), param.dtype
        param.data = torch.empty(0, dtype=torch.uint8, device=param.device)

        def load(p: nn.Parameter, loaded: GGUFTensor | GGUFSlice | torch.Tensor, shard_id: object = None) -> None:
            rows, cols = p.gguf_shape  # this rank's slice of the vocabulary
            _check_shape(loaded, (rows * layer.tp.size, cols))
            t = as_gguf_tensor(loaded.narrow(0, layer.vocab_start, rows))
            pack_segments(p, [t], keeps_packed(p.device, self.packed_on_gpu))

        param.weight_loader = load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """The embedding and a tied head alike: a plain float layer where the table was dequantized."""
        as_float_layer(layer)

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

    def __init__(self, packed_on_gpu: bool = False) -> None:
        """``packed_on_gpu``: the user gave ``quantization="gguf"`` (implied by a GGUF file, the
        blocks are dequantized into the model dtype on a GPU: ``keeps_packed``)."""
        self.packed_modules_mapping: dict[str, list[str]] = {}
        self.packed_on_gpu = packed_on_gpu

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFConfig:
        return cls()

    @classmethod
    def online(cls) -> GGUFConfig:
        raise ValueError("quantization='gguf' needs a GGUF model file (a .gguf path, or a folder holding one)")

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, Linear):
            return GGUFLinearMethod(self.packed_on_gpu)
        if isinstance(layer, (VocabEmbedding, LMHead)):
            return GGUFEmbeddingMethod(self.packed_on_gpu)
        return None

    def weight_iterator(self, source: Any) -> Any:
        return source.iter_weights(gguf_packed=True)

    def describe(self) -> str:
        gpu = ("packed on a GPU too (quantization='gguf' given: the Triton GGUF kernels)" if self.packed_on_gpu else
               "dequantized into the model dtype on a GPU (quantization='gguf' keeps them packed there)")
        return ("gguf (the file's quantized blocks stay packed in the linear layers, embedding and LM head on the "
                f"CPU, {gpu}; load_format='gguf_dequantized' loads them as float instead)")


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
