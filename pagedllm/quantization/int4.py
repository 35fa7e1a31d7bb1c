"""Int4 weights with per-group scales and zero points: the serving form shared by GPTQ and AWQ.

A quantized weight stands for ``W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]`` (``q`` and ``z``
unsigned 4-bit integers, ``s`` float; ``g(k)`` the group of input column ``k``). The checkpoints pack
``q`` and ``z`` eight to an int32 in different ways (``gptq.py`` and ``awq.py`` describe theirs);
after the load, ``Int4LinearMethod.process_weights_after_loading`` rewrites both into one form:

- ``qweight`` int32 in one of two layouts (``layer.int4_layout``), chosen once at load:
  ``ROWS_LAYOUT`` ``[N, K / 8]``: nibble ``j`` (bits ``4j .. 4j+3``) of ``qweight[n, i]`` is
  ``q[n, 8i + j]`` (each output row's codes in input order, contiguous like a float weight row);
  ``N8_LAYOUT`` ``[N / 8, K]`` ("word rows"): a word holds eight output rows of one input column
  (nibble ``j`` is row ``8b + j``: one activation value feeds eight codes), and a word row's
  columns are stored in the order of the CUDA GEMV's loads (``n8_memory_order``): its thread
  ``lane`` of a warp streams the ``run`` columns ``lane * run ..`` (inside one group) while the
  warp's 32 threads read 512 contiguous bytes a load. It is taken on CUDA where the shape suits
  the GEMV (``choose_layout``), the row layout elsewhere;
- ``scales`` and ``zeros`` float16 ``[N, G]`` (the zero points are integers: exact);
- groups are contiguous: column ``k`` is in group ``k // group_size`` (``group_size`` = K for
  ``-1``). A checkpoint whose ``g_idx`` orders columns otherwise (GPTQ act-order) has its columns
  sorted by group at load, and ``perm`` int32 ``[K]`` (else None) says which input column each
  sorted one multiplies: ``y = x[:, perm] @ W_sorted^T``.

Memory: 4 bits a weight plus 4 bytes per group and output row (3% at group 128).

The product (``int4_linear``): on CUDA the Triton kernels of ``kernels/int4_gemm.py`` read the
packed weights once (a GEMV at 1-2 rows, a tiled tensor-core GEMM at decode batch sizes, dequantize +
cuBLAS at prefill sizes); elsewhere, and for shapes they do not take, ``int4_linear_reference``
dequantizes a tile of rows at a time in float32.
"""

from __future__ import annotations

import importlib.util
from abc import abstractmethod
from typing import Any

import torch
from torch import nn

from pagedllm.layers.linear import Linear, MergedLinear, default_weight_loader
from pagedllm.quantization.base import QuantizeMethodBase
from pagedllm.quantization.int4_layout import N8_LAYOUT, PACK, ROWS_LAYOUT, n8_run

SEQUENTIAL_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)
# AWQ's GEMM layout: nibble i of a packed int32 holds column ORDER[i] of its group of eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
HAS_TRITON = importlib.util.find_spec("triton") is not None
# Float32 weight elements the reference path dequantizes at a time (8 MiB).
TILE_ELEMENTS = 1 << 21


def _shifts(order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Bit shift of each of the eight values of a packed int32 (value ``c`` sits at nibble
    ``order.index(c)``)."""
    return torch.tensor([4 * order.index(c) for c in range(PACK)], dtype=torch.int32, device=device)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` int32 -> ``[8R, C]`` int32 in 0..15: nibble ``j`` of row ``i`` is row ``8i + j``."""
    shifts = _shifts(SEQUENTIAL_ORDER, packed.device)
    values = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
    return values.reshape(-1, packed.shape[1])


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] = SEQUENTIAL_ORDER) -> torch.Tensor:
    """``[R, C]`` int32 -> ``[R, 8C]`` int32 in 0..15: column ``8c + order[i]`` is nibble ``i`` of column ``c``."""
    shifts = _shifts(order, packed.device)
    values = (packed[:, :, None] >> shifts[None, None, :]) & 0xF
    return values.reshape(packed.shape[0], -1)


def pack_cols(values: torch.Tensor, order: tuple[int, ...] = SEQUENTIAL_ORDER) -> torch.Tensor:
    """Inverse of ``unpack_cols``: ``[R, 8C]`` integers in 0..15 -> ``[R, C]`` int32."""
    v = values.to(torch.int64).reshape(values.shape[0], -1, PACK)
    shifts = _shifts(order, values.device).to(torch.int64)
    return _to_int32((v << shifts[None, None, :]).sum(dim=2))


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """Inverse of ``unpack_rows``: ``[8R, C]`` integers in 0..15 -> ``[R, C]`` int32."""
    v = values.to(torch.int64).reshape(-1, PACK, values.shape[1])
    shifts = _shifts(SEQUENTIAL_ORDER, values.device).to(torch.int64)
    return _to_int32((v << shifts[None, :, None]).sum(dim=1))


def n8_memory_order(in_features: int, run: int, device: torch.device | None = None) -> torch.Tensor:
    """``[K]`` int64: the input column stored at each position of a word row. In each tile of ``32 *
    run`` columns, load ``r`` of thread ``lane`` (columns ``lane * run + 4r .. +3``) sits at
    positions ``128 r + 4 lane .. +3``."""
    cols = torch.arange(in_features, device=device).view(-1, 32, run // 4, 4)  # (tile, lane, load, 4)
    return cols.transpose(1, 2).reshape(-1)


def pack_n8(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """Codes ``[N, K]`` (0..15) -> the word-row layout ``[N / 8, K]`` int32 (module doc)."""
    return pack_rows(q)[:, n8_memory_order(q.shape[1], n8_run(q.shape[1], group_size), q.device)]


def unpack_n8(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of ``pack_n8``: ``[N / 8, K]`` int32 -> codes ``[N, K]``."""
    k = qweight.shape[1]
    words = torch.empty_like(qweight)
    words[:, n8_memory_order(k, n8_run(k, group_size), qweight.device)] = qweight
    return unpack_rows(words)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (int64) as the int32 with the same bits."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def num_outputs(qweight: torch.Tensor, layout: str) -> int:
    """N of a packed weight in ``layout``."""
    return qweight.shape[0] * PACK if layout == N8_LAYOUT else qweight.shape[0]


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               rows: slice | None = None, layout: str = ROWS_LAYOUT) -> torch.Tensor:
    """The float32 ``W[n, k]`` of a serving-form weight (module doc), for output rows ``rows`` (all
    by default; in the word-row layout ``rows`` starts and stops on multiples of 8)."""
    rows = rows if rows is not None else slice(0, num_outputs(qweight, layout))
    if layout == N8_LAYOUT:
        q = unpack_n8(qweight[rows.start // PACK: rows.stop // PACK], group_size).float()
    else:
        q = unpack_cols(qweight[rows]).float()
    k = q.shape[1]
    expand = lambda t: t[rows].float().repeat_interleave(group_size, dim=1)[:, :k]  # noqa: E731
    return (q - expand(zeros)) * expand(scales)


def int4_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          perm: torch.Tensor | None, group_size: int, layout: str = ROWS_LAYOUT) -> torch.Tensor:
    """``[M, N]`` float32: ``x[:, perm] @ W^T``, dequantizing a tile of weight rows at a time (any device)."""
    xf = x.float() if perm is None else x.float().index_select(1, perm.long())
    n, k = num_outputs(qweight, layout), x.shape[1]
    step = max(PACK, TILE_ELEMENTS // max(k, 1) // PACK * PACK)  # whole word rows
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    for start in range(0, n, step):
        stop = min(n, start + step)
        out[:, start:stop] = xf @ dequantize(qweight, scales, zeros, group_size, slice(start, stop), layout).t()
    return out


def choose_layout(device: torch.device, in_features: int, group_size: int) -> str:
    """The layout a weight is served in (module doc): word rows on CUDA where the GEMV takes the
    shape, else rows."""
    if not (HAS_TRITON and device.type == "cuda"):
        return ROWS_LAYOUT
    from pagedllm.quantization.kernels import int4_gemm

    return N8_LAYOUT if int4_gemm.n8_layout_fits(in_features, group_size) else ROWS_LAYOUT


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                perm: torch.Tensor | None, group_size: int, bias: torch.Tensor | None,
                layout: str = ROWS_LAYOUT) -> torch.Tensor:
    """``x [M, K] @ W^T (+ bias)`` in x's dtype: the Triton kernels on CUDA where they apply, else the
    reference path."""
    if HAS_TRITON and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32):
        from pagedllm.quantization.kernels import int4_gemm

        if int4_gemm.fits(x, qweight, group_size, layout):
            return int4_gemm.int4_linear(x, qweight, scales, zeros, perm, group_size, bias, layout=layout)
    y = int4_linear_reference(x, qweight, scales, zeros, perm, group_size, layout)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def group_order(g_idx: torch.Tensor, group_size: int, num_groups: int) -> torch.Tensor | None:
    """The column order that makes ``g_idx [K]`` (each input column's group) contiguous groups
    (``perm``, int64), or None where ``g_idx`` is ``k // group_size`` already. ValueError unless each
    index is one of the ``num_groups`` groups and every group has ``group_size`` columns (the last
    one may have fewer)."""
    g_idx = g_idx.to(torch.int64)
    expected = torch.arange(g_idx.numel(), device=g_idx.device) // group_size
    if torch.equal(g_idx, expected):
        return None
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups:
        raise ValueError(f"g_idx holds groups outside 0..{num_groups - 1}")
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], expected):
        raise ValueError(f"g_idx does not give every group {group_size} rows (quantization_config.group_size)")
    return perm


def read_group_size(config: dict[str, Any], *keys: str) -> int:
    """The first of ``keys`` present in ``config`` (default 128): -1 or a positive integer."""
    key = next((k for k in keys if k in config), keys[0])
    value = config.get(key, 128)
    if type(value) is not int or (value <= 0 and value != -1):
        raise ValueError(f"quantization: quantization_config.{key} must be -1 or a positive integer, got {value!r}")
    return value


def read_bits(config: dict[str, Any], *keys: str) -> None:
    """ValueError naming the first of ``keys`` present in ``config`` unless it is 4 (the default)."""
    key = next((k for k in keys if k in config), keys[0])
    if config.get(key, 4) != 4:
        raise ValueError(f"quantization: quantization_config.{key}={config.get(key)!r} is not supported: only 4-bit weights are")


class Int4LinearMethod(QuantizeMethodBase):
    """The serving form and product shared by GPTQ and AWQ (module doc). Subclasses create the
    checkpoint's parameters (``create_weights``) and turn them into the serving form
    (``to_serving_form``); ``group_size`` is the scheme's (-1: one group over the whole input)."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def layer_group_size(self, layer: nn.Module) -> int:
        return self.group_size if self.group_size > 0 else layer.in_features

    def num_groups(self, layer: nn.Module) -> int:
        return -(-layer.in_features // self.layer_group_size(layer))

    def check_layer(self, layer: Linear, scheme: str) -> None:
        """ValueError naming ``quantization`` for a layer the packed layouts cannot hold."""
        if getattr(layer, "tp", None) is not None and layer.tp.size > 1:
            raise ValueError(f"quantization={scheme!r} with tensor_parallel_size > 1 is not supported yet")
        sizes = layer.output_sizes if isinstance(layer, MergedLinear) else [layer.out_features]
        if layer.in_features % PACK or any(size % PACK for size in sizes):
            raise ValueError(f"quantization={scheme!r}: a {type(layer).__name__} of {layer.in_features} inputs and "
                             f"outputs {sizes} cannot hold int4 weights packed by {PACK}")

    def take_weight(self, layer: Linear) -> tuple[tuple | None, torch.device]:
        """Remove the layer's float ``weight`` (the scheme's packed parameters replace it); returns
        its shard ids and device, for those parameters."""
        shard_ids, device = getattr(layer.weight, "shard_ids", None), layer.weight.device
        del layer.weight
        return shard_ids, device

    @abstractmethod
    def init_dummy_weights(self, layer: nn.Module, generator: torch.Generator, std: float) -> None:
        """Random checkpoint-form values (before ``process_weights_after_loading``) whose dequantized
        weights have about ``std`` (benchmarks)."""

    @abstractmethod
    def to_serving_form(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor | None]:
        """``(q [N, K] codes, scales [N, G], zeros [N, G], perm or None)`` from the loaded parameters
        (``q`` in serving order: sorted by group where ``perm`` is given)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scales, zeros, perm = self.to_serving_form(layer)
        layout = choose_layout(q.device, layer.in_features, self.layer_group_size(layer))
        qweight = pack_n8(q, self.layer_group_size(layer)) if layout == N8_LAYOUT else pack_cols(q)
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if hasattr(layer, name):
                delattr(layer, name)
        layer.qweight = nn.Parameter(qweight.contiguous(), requires_grad=False)
        layer.scales = nn.Parameter(scales.to(torch.float16).contiguous(), requires_grad=False)
        layer.zeros = nn.Parameter(zeros.to(torch.float16).contiguous(), requires_grad=False)
        layer.perm = None if perm is None else nn.Parameter(perm.to(torch.int32), requires_grad=False)
        layer.int4_layout = layout

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = int4_linear(x2, layer.qweight, layer.scales, layer.zeros, layer.perm, self.layer_group_size(layer), bias,
                        layer.int4_layout)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def new_param(layer: Linear, name: str, tensor: torch.Tensor, loader, shard_ids: tuple | None) -> None:
    """Register ``tensor`` as ``layer.<name>`` with ``loader`` and the layer's ``shard_ids`` (so the
    model reports a missing shard as it reports a missing weight)."""
    param = nn.Parameter(tensor, requires_grad=False)
    param.weight_loader = loader
    if shard_ids is not None:
        param.shard_ids = shard_ids
    setattr(layer, name, param)


def output_dim_loader(layer: Linear, dim: int, pack: int):
    """A loader for a parameter whose ``dim`` runs over output columns, ``pack`` of them per element:
    a merged layer's shard fills its columns (a checkpoint tensor of all shards, ``shard_id`` None,
    is split by the shards' sizes); any other layer takes the tensor whole."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if not isinstance(layer, MergedLinear):
            default_weight_loader(param, loaded)
            return
        shards = range(len(layer.output_sizes)) if shard_id is None else [layer.shard_names.index(shard_id)]
        start = 0
        for i in shards:
            size = layer.output_sizes[i] // pack
            part = loaded.narrow(dim, start, size) if shard_id is None else loaded
            default_weight_loader(param.narrow(dim, layer.offsets[i] // pack, size), part)
            start += size
        if shard_id is None and start != loaded.shape[dim]:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the merged projections {layer.output_sizes}")

    return load


def random_words(shape: tuple[int, ...], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Uniformly random int32 words (eight uniform nibbles each), for dummy weights."""
    words = torch.randint(-(1 << 31), 1 << 31, shape, generator=generator, device=device, dtype=torch.int64)
    return words.to(torch.int32)


def packed_constant(value: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Int32 words of ``shape`` with all eight nibbles ``value`` (the same in any nibble order)."""
    word = sum(value << (4 * j) for j in range(PACK))
    return _to_int32(torch.full(shape, word, dtype=torch.int64, device=device))


# The std of ``q - 8`` for uniform nibbles q: dummy scales of ``std / DUMMY_SPREAD`` give weights of about ``std``.
DUMMY_SPREAD = 4.6
