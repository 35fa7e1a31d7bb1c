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

from pagedllm.loader.architectures import gguf_permutes_qk
from pagedllm.loader.cache import ensure_entry, gguf_cache_folder, write_atomically

logger = logging.getLogger(__name__)

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

        array = dequantize(self.data.numpy(), GGMLQuantizationType(self.qtype))
        return torch.from_numpy(np.ascontiguousarray(array)).reshape(self.shape)


def _read_gguf(path: Path, packed: bool = False) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """(HF name, tensor) for every tensor: float32, or with ``packed`` a ``GGUFTensor`` for every
    2-D tensor that is not F32."""
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
        keep = packed and t.tensor_type != GGMLQuantizationType.F32 and len(t.shape) == 2
        # Packed: the blocks as bytes [rows, row_bytes]; else float32 in HF shape [out, in].
        array = np.asarray(t.data).view(np.uint8).reshape(int(t.shape[1]), -1) if keep else \
            dequantize(t.data, t.tensor_type)
        if not array.flags.writeable:  # a view into the memory-mapped file
            array = np.array(array)
        w = torch.from_numpy(array)
        if permuted and ".self_attn.q_proj." in name:
            w = unpermute_qk(w, num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = unpermute_qk(w, num_kv_heads)
        w = w.contiguous()
        yield name, GGUFTensor(int(t.tensor_type), (int(t.shape[1]), int(t.shape[0])), w) if keep else w


def iter_gguf_packed_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """(HF name, weight) for every weight of a GGUF file: a ``GGUFTensor`` for each quantized (or
    F16 / BF16) matrix, a float32 tensor for the rest (norms, biases)."""
    return _read_gguf(Path(path), packed=True)


def iter_gguf_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every weight of a GGUF file.

    Small models (< MAX_CACHED_WEIGHT_BYTES dequantized) are cached as ``weights.safetensors`` in the
    GGUF cache folder on the first full pass and read from there afterwards.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = Path(path)
    cached = gguf_cache_folder(path) / "weights.safetensors"
    if cached.is_file():
        with safe_open(str(cached), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
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
