"""The attention boundary: the backend contract, per-step metadata and a scoped forward context.

KV cache layout (one tensor per layer, ``KVCacheSpec``): ``[2, num_blocks, block_size,
num_kv_heads, head_dim]``; index 0 holds keys, 1 values. Token ``i`` of a request lives in slot
``block_table[i // block_size] * block_size + i % block_size``.

A batch is ragged: request ``r`` contributes queries ``query_start_loc[r]:query_start_loc[r+1]``,
which are the *last* ``query_len`` tokens of its ``seq_len`` tokens of context (the earlier ones
are already in the cache: computed in earlier steps or hit in the prefix cache). Query ``j`` of
request ``r`` sits at position ``seq_len - query_len + j`` and attends causally to positions
``0..that position``. Decode (query_len 1), chunked prefill and prefix hits are all this one case.

Two per-layer options refine that (``Attention`` passes them; None turns each off):
- ``sliding_window`` W: a query at position p sees only keys ``p - W + 1 .. p`` (W keys, itself
  included, as in HF's sliding masks). Backends never read a key outside every query's window: a
  model whose every layer slides may have given those blocks back (``core/kv_cache_manager.py``),
  so their block-table entries may point at blocks another request now owns.
- ``logits_soft_cap`` c (Gemma 2): each scaled score s becomes ``c * tanh(s / c)`` before the mask
  and the softmax.

What a backend provides (``AttentionBackend``): its metadata builder (the runner hands it one
step's ``CommonAttentionInputs`` once and passes the result to every layer), its KV-cache spec,
its KV writer (what fused RoPE / projection kernels call to store K/V themselves, or None), the
query-length mixes that warm up its kernels, and whether its decode steps can be CUDA graphs.
Backends are chosen by name in ``registry.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class CommonAttentionInputs:
    """One step's attention inputs as the runner stages them, common to every backend.

    Device tensors plus host copies (numpy) of the two per-request arrays, for backends that plan
    on the host; ``longest_first`` is an int32 permutation of the requests by decreasing seq_len,
    staged only when the backend asks for it (``uses_longest_first_order``) and the batch is large.
    Invariant: ``query_start_loc[-1] == num_actual_tokens`` and ``seq_lens[r] >= query_len[r]``.
    """

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1 = no KV write (padding, dummy runs)
    query_start_loc_host: np.ndarray | None = None
    seq_lens_host: np.ndarray | None = None
    longest_first: torch.Tensor | None = None


def common_inputs_from_lists(query_lens: Sequence[int], seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                             slot_mapping: Sequence[int], device: torch.device | str) -> CommonAttentionInputs:
    """Common inputs from Python lists (start-up dummy batches, tests). Cost: a few small copies."""
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    lens = np.asarray(seq_lens, dtype=np.int32)
    width = max((len(t) for t in block_tables), default=1) or 1
    tables = np.zeros((len(block_tables), width), dtype=np.int32)
    for r, table in enumerate(block_tables):
        tables[r, : len(table)] = table
    return CommonAttentionInputs(
        num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens, default=0),
        query_start_loc=torch.from_numpy(qsl).to(device), seq_lens=torch.from_numpy(lens).to(device),
        block_tables=torch.from_numpy(tables).to(device),
        slot_mapping=torch.tensor(list(slot_mapping), dtype=torch.int64, device=device),
        query_start_loc_host=qsl, seq_lens_host=lens,
    )


@dataclass
class AttentionMetadata:
    """Per-step attention inputs every backend reads (tensors on the model's device); a backend's
    own metadata subclasses it with what only that backend needs.

    Invariant: ``query_start_loc[-1] == num_actual_tokens <= len(slot_mapping)`` (slot_mapping may
    be longer when padded for CUDA graphs; padded slots are -1 and skipped by the KV store), and
    ``seq_lens[r] >= query_len[r]`` for every request.
    """

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [num_tokens]

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])


class AttentionMetadataBuilder:
    """Builds a backend's metadata once per step from the common inputs. Stateless; the base
    builder copies the common fields (no host work, no device work)."""

    def build(self, common: CommonAttentionInputs) -> AttentionMetadata:
        return AttentionMetadata(common.num_actual_tokens, common.max_query_len, common.query_start_loc,
                                 common.seq_lens, common.block_tables, common.slot_mapping)


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV cache one attention layer needs: ``shape(num_blocks)`` of ``dtype`` in the layout of
    the module doc ("NHD": tokens, then heads, then head dims within a block)."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    layout: str = "NHD"

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of one layer (keys and values)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


@dataclass(frozen=True)
class KVWriter:
    """How K/V reach a backend's cache from outside it: a fused kernel that writes the ``layout``
    at ``metadata.slot_mapping`` itself may then call ``forward(..., kv_stored=True)``; ``store`` is
    the backend's own writer ``(key, value, kv_cache, slot_mapping)`` for the unfused path."""

    layout: str
    store: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class AttentionBackend:
    """Interface every backend implements. Models never see a backend directly: the
    ``Attention`` layer fetches it from the forward context."""

    name = "base"
    metadata_builder: AttentionMetadataBuilder = AttentionMetadataBuilder()
    # Not None where a fused kernel may store this step's K/V itself (see KVWriter).
    kv_writer: KVWriter | None = None
    # Whether a pure decode step (every query_len 1, padded) can be captured as a CUDA graph.
    supports_decode_graphs = False
    # Whether the metadata takes ``CommonAttentionInputs.longest_first`` (a launch order).
    uses_longest_first_order = False

    @property
    def accepts_stored_kv(self) -> bool:
        """Whether ``forward(..., kv_stored=True)`` is supported (a KV writer exists)."""
        return self.kv_writer is not None

    def kv_cache_spec(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int) -> KVCacheSpec:
        return KVCacheSpec(block_size, num_kv_heads, head_dim, dtype)

    def warmup_query_lens(self, max_query_len: int) -> list[list[int]]:
        """The query-length mixes whose eager forwards compile every kernel variant a step can take
        (each request over a slightly longer context); none where nothing compiles."""
        return []

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor | None,  # [T, num_kv_heads, head_dim]; None only with kv_stored
        value: torch.Tensor | None,  # [T, num_kv_heads, head_dim]; None only with kv_stored
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,  # built by this backend's metadata_builder
        scale: float,
        kv_stored: bool = False,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Store key/value at ``meta.slot_mapping`` (unless ``kv_stored``), then attend as described
        in the module doc (with the layer's sliding window and logit soft cap)."""
        raise NotImplementedError  # abstract: each backend defines it


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    backend: AttentionBackend


_current: list[ForwardContext] = []


@contextlib.contextmanager
def forward_context(attn_metadata: AttentionMetadata, backend: AttentionBackend) -> Iterator[ForwardContext]:
    """Scope the per-batch state of one forward pass (DESIGN rule 4). Not re-entrant."""
    assert not _current, "forward_context is already active: nested forward passes are a bug"
    ctx = ForwardContext(attn_metadata, backend)
    _current.append(ctx)
    try:
        yield ctx
    finally:
        _current.pop()


def get_forward_context() -> ForwardContext:
    assert _current, "attention called outside forward_context(): the runner must set the batch metadata"
    return _current[0]
