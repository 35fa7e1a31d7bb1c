"""KV store ("reshape and cache"): scatter each token's K/V rows into the paged cache.

Cost: one program per token, each reads and writes ``2 * num_kv_heads * head_dim`` elements once;
the launch grid is ``num_tokens`` (a host shape), so the store is CUDA-graph capturable. A float8
cache (``kv_cache_dtype="fp8*"``) stores each value cast as it is (scale 1.0), clamped to the
format's largest finite value first (``attention/kv_dtype.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def slot_offset(slot, stride_c_blk, stride_c_slot, BLOCK_SIZE: tl.constexpr):
    """Element offset of cache slot ``slot`` (``block * BLOCK_SIZE + offset``) in one half (K or V) of
    the paged cache ``[num_blocks, BLOCK_SIZE, Hkv, D]``: the layout, for kernels of other modules that
    store K/V themselves (the fused RoPE and qkv GEMV kernels); add ``head * stride_c_head + dim``."""
    return (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_slot


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_blk,
    stride_c_slot,
    stride_c_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SATURATE_AT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token (CUDA-graph batch padding): nothing to store
        return
    block = slot // BLOCK_SIZE
    offset_in_block = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    if SATURATE_AT > 0:  # a float8 cache: saturate rather than overflow to NaN
        k = tl.clamp(k.to(tl.float32), -SATURATE_AT, SATURATE_AT)
        v = tl.clamp(v.to(tl.float32), -SATURATE_AT, SATURATE_AT)
    dst = (
        block * stride_c_blk
        + offset_in_block * stride_c_slot
        + heads[:, None] * stride_c_head
        + dims[None, :]
    )
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key[i]``/``value[i]`` (``[T, num_kv_heads, head_dim]``) into slot ``slot_mapping[i]``.

    ``kv_cache`` is ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` with a contiguous last
    dim. Tokens past ``len(slot_mapping)`` and tokens whose slot is negative are skipped.
    """
    num_tokens = min(key.shape[0], slot_mapping.shape[0])
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.stride(-1) == 1
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        SATURATE_AT=torch.finfo(kv_cache.dtype).max if kv_cache.element_size() == 1 else 0.0,
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )
