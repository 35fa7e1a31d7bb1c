"""GGUF weights as Hugging Face tensors: dequantize with the ``gguf`` package, rename, un-permute.

llama.cpp stores tensors under its own names (``blk.3.attn_q.weight``) and, for the ``llama``
architecture (Llama, Mistral, SmolLM2), permutes the rows of Q and K so that its rotary kernel can
rotate adjacent pairs (GPT-J style) instead of the two halves of a head (NeoX style, which HF and we
use). ``unpermute_qk`` undoes that. Qwen2/Qwen3 GGUFs are stored NeoX style and need nothing.

Two ways to read the weights:

- ``iter_gguf_weights``: every tensor dequantized to float32 (the dequantized-float path). Cost:
  parsing the file with ``GGUFReader`` (~2 s for SmolLM2, mostly its tokenizer fields) plus
  dequantization (~1 s for 135M params). Small models' dequantized weights are cached as one
  float32 safetensors file.
- ``iter_gguf_packed_weights``: the 2-D tensors of any other type than F32 come as ``GGUFTensor``
  (their blocks, unchanged apart from the Q/K row order); the F32 ones (norms, biases) as float32
  tensors. Cost: the parse and one copy of the packed bytes (no cache needed).

Under tensor or pipeline parallelism (a group of more than one rank) both yield every matrix as
a ``GGUFSlice`` (a view of its bytes in the memory-mapped file, like ``weights.SafetensorsSlice``):
a rank's loader narrows it to its slice and only the bytes of that slice are read. A slice of
output rows (column-parallel, vocabulary-parallel) is a run of whole rows; a slice of input
columns (row-parallel) is a run of blocks in every row, read packed where its bounds fall on block
bounds, else the blocks it overlaps are dequantized and trimmed (on the packed path too: that
rank's slice of the matrix is then served as float32 rows, with a warning).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm.distributed import get_pp_group, get_tp_group
from pagedllm.loader.architectures import gguf_permutes_qk
from pagedllm.loader.cache import ensure_entry, gguf_cache_folder, write_atomically
from pagedllm.loader.weights import SafetensorsSlice

logger = logging.getLogger(__name__)

F32 = 0  # GGMLQuantizationType.F32
# Cache the dequantized weights only while their float32 size stays below this (the file is that big).
MAX_CACHED_WEIGHT_BYTES = 2 << 30

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama3-style GGUFs carry the scaled rotary frequencies; we compute them from the config instead.
_SKIPPED_NAMES = {"rope_freqs"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_to_hf_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for skipped tensors.
    Unknown names come back unchanged (the model's load_weights then reports them as unexpected)."""
    base, _, suffix = name.rpartition(".")
    if base in _SKIPPED_NAMES:
        return None
    if base in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[base]}.{suffix}"
    m = _BLOCK_RE.fullmatch(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return name


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's ``permute``: within each head, rows were reordered from
    (half, pair-index) to (pair-index, half); put them back. Works for weights and biases."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_field(reader: Any, key: str, default: Any = None) -> Any:
    """A scalar or string metadata field of a GGUFReader (portable across gguf versions)."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return default
    part = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(part).decode("utf-8")
    return part.tolist()[0]


@dataclass(frozen=True)
class GGUFTensor:
    """One GGUF matrix kept in its blocks. ``data``: uint8 ``[rows, row_bytes]``, each row the
    ``cols // block_elems`` blocks of llama.cpp's layout for ``qtype`` (a ``GGMLQuantizationType``
    value; F16 rows are 2 bytes a weight); ``shape``: ``(rows, cols)`` of the weights it holds.
    Invariant: ``data.shape[0] == rows`` and the rows are in Hugging Face order (Q/K unpermuted)."""

    qtype: int
    shape: tuple[int, int]
    data: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """Float32 ``shape``, as ``gguf.quants.dequantize`` computes it."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        array = dequantize(self.data.contiguous().numpy(), GGMLQuantizationType(self.qtype))
        return torch.from_numpy(np.ascontiguousarray(array)).reshape(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> GGUFTensor:
        """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, start + length)`` still in their blocks
        (a view of ``data``); columns that cut blocks come dequantized, as F32 rows."""
        rows, cols = (start, length), (0, self.shape[1])
        if dim == 1:
            rows, cols = (0, self.shape[0]), (start, length)
        covering, offset = _covering_blocks(self.data, self.qtype, self.shape, rows, cols)
        return _whole_blocks(covering, offset, cols, "")


def block_geometry(qtype: int) -> tuple[int, int]:
    """``(weights, bytes)`` of one block of GGML type ``qtype`` (F32: ``(1, 4)``; Q8_0: ``(32, 34)``)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


def _covering_blocks(raw: np.ndarray | torch.Tensor, qtype: int, shape: tuple[int, int],
                     rows: tuple[int, int], cols: tuple[int, int]) -> tuple[GGUFTensor, int]:
    """The blocks of ``raw`` (the ``[rows, row_bytes]`` bytes of a ``shape`` matrix) holding rows
    ``rows = (start, length)`` and columns ``cols = (start, length)``: a ``GGUFTensor`` of whole
    blocks and the first wanted column's offset in it. Only those bytes are read from ``raw`` (a
    memory map: a copy of them; a tensor: a view)."""
    (row_start, num_rows), (col_start, num_cols) = rows, cols
    if not (0 <= row_start and num_rows >= 0 and row_start + num_rows <= shape[0]
            and 0 <= col_start and num_cols >= 0 and col_start + num_cols <= shape[1]):
        raise ValueError(f"slice rows {rows}, columns {cols} (start, length) is outside the matrix {shape}")
    block, block_bytes = block_geometry(qtype)
    first, end = col_start // block, -(-(col_start + num_cols) // block)
    part = raw[row_start:row_start + num_rows, first * block_bytes:end * block_bytes]
    data = torch.from_numpy(np.array(part)) if isinstance(part, np.ndarray) else part
    return GGUFTensor(qtype, (num_rows, (end - first) * block), data), col_start - first * block


def _whole_blocks(covering: GGUFTensor, offset: int, cols: tuple[int, int], name: str) -> GGUFTensor:
    """Columns ``cols = (start, length)`` of ``covering`` (the blocks holding them, first wanted
    column at ``offset``): those blocks where the slice falls on block bounds, else (a rank's slice
    that cuts blocks: they cannot be cut packed) the slice dequantized exactly, as F32 rows."""
    if not offset and covering.shape[1] == cols[1]:
        return covering
    _warn_cut_blocks(name, covering.qtype, cols[1])
    values = covering.dequantize().narrow(1, offset, cols[1]).contiguous()
    return GGUFTensor(F32, tuple(values.shape), values.view(torch.uint8))


def _warn_cut_blocks(name: str, qtype: int, num_cols: int) -> None:
    """Warn once per process and (format, slice width): every layer of a model repeats it."""
    from gguf import GGMLQuantizationType

    if (qtype, num_cols) in _REPORTED_CUTS:
        return
    _REPORTED_CUTS.add((qtype, num_cols))
    logger.warning("tensor_parallel_size: %s (%s) is split at %d input features a rank, not a multiple of its "
                   "%d-weight blocks: each rank's slice of such matrices is dequantized to float32 at load "
                   "(4 bytes a weight)", name or "a GGUF matrix", GGMLQuantizationType(qtype).name, num_cols,
                   block_geometry(qtype)[0])


_REPORTED_CUTS: set[tuple[int, int]] = set()  # (GGML type, slice width) already warned about


class GGUFSlice:
    """A GGUF matrix not read yet: ``raw`` is its ``[rows, row_bytes]`` bytes in the memory-mapped
    file, ``shape`` its Hugging Face ``(out, in)``. ``narrow(dim, start, length)`` reads only the
    blocks of that slice: with ``packed`` a ``GGUFTensor`` of them (a column slice that cuts blocks:
    those blocks dequantized and trimmed, as F32 rows, with a warning), else float32 values of
    exactly the slice (the blocks it overlaps, dequantized and trimmed). ``permuted_heads``: Q/K rows that llama.cpp
    permuted within each of that many heads (a slice reads the whole heads it touches, unpermutes
    them, then trims). Any other use (a torch function, an attribute) reads the whole matrix, as
    ``materialize()``. Invariant: the values equal ``narrow(dequantize(whole))`` bit for bit. Cost
    of a slice: a copy of its blocks' bytes (Q/K: of the whole heads it touches), plus their
    dequantization on the float path."""

    def __init__(self, name: str, raw: np.ndarray, qtype: int, shape: tuple[int, int],
                 permuted_heads: int | None = None, packed: bool = False) -> None:
        self.name, self.raw, self.qtype, self.packed = name, raw, qtype, packed
        self.shape = torch.Size(shape)
        self.permuted_heads = permuted_heads

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor | GGUFTensor:
        if dim not in (0, 1):
            raise ValueError(f"{self.name}: a GGUF matrix has dims 0 and 1, not {dim}")
        rows, cols = ((start, length), (0, self.shape[1])) if dim == 0 else ((0, self.shape[0]), (start, length))
        read_rows = rows
        if self.permuted_heads:  # read whole heads: the permutation moves rows within a head
            head_rows = self.shape[0] // self.permuted_heads
            first, end = rows[0] // head_rows * head_rows, -(-(rows[0] + rows[1]) // head_rows) * head_rows
            read_rows = (first, end - first)
        covering, offset = _covering_blocks(self.raw, self.qtype, tuple(self.shape), read_rows, cols)
        data = covering.data
        if self.permuted_heads:
            data = unpermute_qk(data, read_rows[1] // (self.shape[0] // self.permuted_heads))
            data = data.narrow(0, rows[0] - read_rows[0], rows[1])
        covering = GGUFTensor(self.qtype, (rows[1], covering.shape[1]), data.contiguous())
        if self.packed:
            return _whole_blocks(covering, offset, cols, self.name)
        return covering.dequantize().narrow(1, offset, cols[1]).contiguous()

    def materialize(self) -> torch.Tensor | GGUFTensor:
        return self.narrow(0, 0, self.shape[0])

    def __getattr__(self, name: str):
        return getattr(self.materialize(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(x):
            return x.materialize() if isinstance(x, GGUFSlice) else x

        return func(*map(real, args), **{k: real(v) for k, v in (kwargs or {}).items()})


def _read_gguf(path: Path, packed: bool = False,
               lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | GGUFTensor | GGUFSlice]]:
    """(HF name, tensor) for every tensor: float32, or with ``packed`` a ``GGUFTensor`` for every
    2-D tensor that is not F32; with ``lazy`` every 2-D tensor as a ``GGUFSlice`` (read on use)."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch = read_field(reader, "general.architecture")
    num_heads = read_field(reader, f"{arch}.attention.head_count")
    num_kv_heads = read_field(reader, f"{arch}.attention.head_count_kv", num_heads)
    permuted = gguf_permutes_qk(arch)
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        if name is None:
            continue
        heads = None
        if permuted and ".self_attn.q_proj." in name:
            heads = num_heads
        elif permuted and ".self_attn.k_proj." in name:
            heads = num_kv_heads
        matrix = len(t.shape) == 2
        keep = packed and t.tensor_type != GGMLQuantizationType.F32 and matrix
        # The blocks as bytes [rows, row_bytes] (a view of the memory map, nothing read yet).
        raw = np.asarray(t.data).view(np.uint8).reshape(int(t.shape[1]), -1) if matrix else None
        shape = (int(t.shape[1]), int(t.shape[0])) if matrix else None
        if lazy and matrix:
            yield name, GGUFSlice(name, raw, int(t.tensor_type), shape, heads, keep)
            continue
        # Packed: the blocks as bytes [rows, row_bytes]; else float32 in HF shape [out, in].
        array = np.array(raw) if keep else dequantize(t.data, t.tensor_type)
        if not array.flags.writeable:  # a view into the memory-mapped file
            array = np.array(array)
        w = torch.from_numpy(array)
        if heads:
            w = unpermute_qk(w, heads)
        w = w.contiguous()
        yield name, GGUFTensor(int(t.tensor_type), shape, w) if keep else w


def _lazy_default(lazy: bool | None) -> bool:
    """Unread matrices where a rank loads a part of the model: its slices (tensor parallel), its
    layers (pipeline parallel: another stage's layers are then never read)."""
    return get_tp_group().size > 1 or get_pp_group().size > 1 if lazy is None else lazy


def iter_gguf_packed_weights(path: str | Path,
                             lazy: bool | None = None) -> Iterator[tuple[str, torch.Tensor | GGUFTensor | GGUFSlice]]:
    """(HF name, weight) for every weight of a GGUF file: a ``GGUFTensor`` for each quantized (or
    F16 / BF16) matrix, a float32 tensor for the rest (norms, biases). ``lazy`` (default: under
    tensor or pipeline parallelism): every matrix as a ``GGUFSlice`` instead (its loader reads its
    slice; another pipeline stage's layers are not read)."""
    return _read_gguf(Path(path), packed=True, lazy=_lazy_default(lazy))


def iter_gguf_weights(path: str | Path, lazy: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every weight of a GGUF file.

    Small models (< MAX_CACHED_WEIGHT_BYTES dequantized) are cached as ``weights.safetensors`` in the
    GGUF cache folder on the first full pass and read from there afterwards. ``lazy`` (default:
    under tensor or pipeline parallelism): every matrix comes unread (a ``SafetensorsSlice`` of the
    cache, else a ``GGUFSlice`` of the file), so that a rank reads only its slices; a lazy pass
    writes no cache.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = Path(path)
    lazy = _lazy_default(lazy)
    cached = gguf_cache_folder(path) / "weights.safetensors"
    if cached.is_file():
        with safe_open(str(cached), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, SafetensorsSlice(f, name) if lazy else f.get_tensor(name)
        return
    if lazy:
        yield from _read_gguf(path, lazy=True)
        return
    collected: dict[str, torch.Tensor] | None = {}
    collected_bytes = 0
    for name, w in _read_gguf(path):
        if collected is not None:
            collected[name] = w
            collected_bytes += w.numel() * w.element_size()
            if collected_bytes > MAX_CACHED_WEIGHT_BYTES:
                collected = None  # too big to cache: stop holding on to the tensors
        yield name, w
    if collected:
        ensure_entry(cached.parent, path)
        write_atomically(cached, lambda tmp: save_file(collected, str(tmp)))
