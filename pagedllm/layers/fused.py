"""A norm or activation followed by a linear layer, as one GEMV launch at decode batch 1-2.

At 1-2 token rows a decoder layer's step is dominated by launch gaps, not by bytes, so where the
linear layer would take the Triton GEMV (``triton_ops.use_skinny_gemm``) the op before it runs in
the GEMV's prologue (``kernels/fused_gemv.py``):

- ``fused_norm_linear(norm, linear, x, residual)``: residual add + RMSNorm + linear (qkv_proj,
  gate_up_proj) -> ``(y, new_residual)``;
- ``fused_silu_and_mul_linear(act, linear, x)``: SiLU-and-mul + linear (down_proj) -> ``y``.

Elsewhere (CPU, prefill, layers where cuBLAS wins) each is the two modules called one after the
other, exactly as before. Invariant: both paths give the unfused result up to float32 summation
order (the kernels round where the torch path rounds), and neither writes its inputs.

Cost on the fused path: one launch instead of two and no round trip of the normed / activated row
through memory; each GEMV program recomputes the norm (or activation) of the M input rows from L2.
"""

from __future__ import annotations

import torch

from pagedllm.layers import triton_ops
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.linear import Linear
from pagedllm.layers.norm import RMSNorm


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
