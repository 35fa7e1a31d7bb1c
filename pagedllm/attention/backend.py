"""The attention boundary: per-batch metadata, a scoped forward context, and the backend interface.

KV cache layout (one tensor per layer): ``[2, num_blocks, block_size, num_kv_heads, head_dim]``;
index 0 holds keys, 1 values. Token ``i`` of a request lives in slot
``block_table[i // block_size] * block_size + i % block_size``.

A batch is ragged: request ``r`` contributes queries ``query_start_loc[r]:query_start_loc[r+1]``,
which are the *last* ``query_len`` tokens of its ``seq_len`` tokens of context (the earlier ones
are already in the cache: computed in earlier steps or hit in the prefix cache). Query ``j`` of
request ``r`` sits at position ``seq_len - query_len + j`` and attends causally to positions
``0..that position``. Decode (query_len 1), chunked prefill and prefix hits are all this one case.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-batch attention inputs. Tensors live on the model's device.

    Invariant: ``query_start_loc[-1] == num_actual_tokens == len(slot_mapping)`` (slot_mapping may
    be longer when padded for CUDA graphs; padded slots are -1 and skipped by the KV store), and
    ``seq_lens[r] >= query_len[r]`` for every request.
    """

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    # Host copies (python lists) for backends that plan on the CPU (the reference backend).
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # Optional int32 [num_reqs] permutation of the requests, longest seq_len first: the order in
    # which a GPU decode kernel should start them (load balance at large batch). Changes no result.
    decode_order: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])


class AttentionBackend:
    """Interface every backend implements. Models never see a backend directly: the
    ``Attention`` layer fetches it from the forward context."""

    name = "base"
    # Whether ``forward(..., kv_stored=True)`` is supported: the caller (a fused RoPE kernel) has
    # already written this step's K/V at ``meta.slot_mapping``, and the backend only attends.
    accepts_stored_kv = False

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor | None,  # [T, num_kv_heads, head_dim]; None only with kv_stored
        value: torch.Tensor | None,  # [T, num_kv_heads, head_dim]; None only with kv_stored
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Store key/value at ``meta.slot_mapping`` (unless ``kv_stored``), then attend as described
        in the module doc."""
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


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """Pick a backend: "auto" means Triton on CUDA, the native-kernel CPU backend elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "cpu":
        from pagedllm.attention.cpu_backend import CpuBackend

        return CpuBackend()
    if name == "torch_ref":
        from pagedllm.attention.torch_ref import TorchRefBackend

        return TorchRefBackend()
    if name == "triton":
        from pagedllm.attention.triton_backend import TritonBackend

        return TritonBackend()
    raise ValueError(f"attention_backend must be 'auto', 'cpu', 'torch_ref' or 'triton', got {name!r}")
