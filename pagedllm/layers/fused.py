"""A norm or activation followed by a linear layer, as one GEMV launch at decode batch 1-2.

At 1-2 token rows a decoder layer's step is dominated by launch gaps, not by bytes, so where the
linear layer would take the Triton GEMV (``triton_ops.use_skinny_gemm``) the op before it runs in
the GEMV's prologue (``kernels/fused_gemv.py``):

- ``fused_norm_linear(norm, linear, x, residual)``: residual add + RMSNorm + linear (qkv_proj,
  gate_up_proj) -> ``(y, new_residual)``;
- ``fused_silu_and_mul_linear(act, linear, x)``: SiLU-and-mul + linear (down_proj) -> ``y``;
- ``fused_norm_qkv_rope(...)``: at one row, for models without a q/k norm, residual add + RMSNorm +
  qkv_proj + RoPE of q and k + the KV store -> ``(q rotated, new_residual)``, or None where it does
  not apply (the caller then runs ``fused_norm_linear`` and the RoPE launch).

Elsewhere (CPU, prefill, layers where cuBLAS wins) each is the two modules called one after the
other, exactly as before. Invariant: both paths give the unfused result up to float32 summation
order and, after a norm, one rounding of the normed row (which the fused GEMVs never round); neither
writes its inputs.

Cost on the fused path: one launch instead of two and no round trip of the normed / activated row
through memory; each GEMV program recomputes the norm (or activation) of the M input rows from L2.
"""

from __future__ import annotations

import torch

from pagedllm.layers import triton_ops
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import Linear, QKVLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding


def fused_norm_linear(
    norm: RMSNorm, linear: Linear, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear(norm(x + residual))`` and the new residual stream ``x + residual`` (a new tensor);
    without a residual (the first layer), ``linear(norm(x))`` and ``x`` itself."""
    if triton_ops.use_fused_norm_linear(x, residual, norm.weight, linear.weight):
        return triton_ops.rms_norm_linear(x, residual, norm.weight, norm.eps, linear.weight, linear.bias)
    if residual is None:
        return linear(norm(x)), x
    hidden, residual = norm(x, residual)
    return linear(hidden), residual


def fused_silu_and_mul_linear(act: SiluAndMul, linear: Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear(act(x))`` for ``x = [gate | up]``."""
    if triton_ops.use_fused_silu_and_mul_linear(x, linear.weight):
        return triton_ops.silu_and_mul_linear(x, linear.weight, linear.bias)
    return linear(act(x))


def fused_norm_qkv_rope(
    norm: RMSNorm, qkv_proj: QKVLinear, rotary_emb: RotaryEmbedding, attn: Attention, x: torch.Tensor,
    residual: torch.Tensor | None, positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q rotated [1, Hq * D], new_residual)`` with this row's rotated k and its v already in
    ``attn``'s cache (attend with ``attn(q, None, None, kv_stored=True)``), in one launch; None unless
    that applies: one token row on the fused GEMV path, a backend that takes stored K/V, and RoPE over
    the whole head. For models without a q/k norm (the caller's check)."""
    target = attn.kv_store_target()
    if target is None or rotary_emb.rotary_dim != attn.head_dim:
        return None
    kv_cache, slot_mapping = target
    if not triton_ops.use_fused_norm_qkv_rope(x, residual, norm.weight, qkv_proj.weight, rotary_emb.cos_cache,
                                              kv_cache):
        return None
    return triton_ops.rms_norm_qkv_rope(x, residual, norm.weight, norm.eps, qkv_proj.weight, qkv_proj.bias,
                                        positions, rotary_emb.cos_cache, rotary_emb.sin_cache, attn.num_heads,
                                        attn.num_kv_heads, kv_cache, slot_mapping)
