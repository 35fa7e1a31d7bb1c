"""Gated activation for merged gate/up projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers import triton_ops
from pagedllm.native import kernels as native


class SiluAndMul(nn.Module):
    """``x = [gate | up]`` (last dim 2*I) -> ``silu(gate) * up`` (last dim I).

    Cost: on CUDA one fused Triton launch (reads 2*I, writes I per row); on the CPU in float32 the same
    pass in C (``native.silu_and_mul``); elsewhere two torch ops.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_ops.use_fused(x) and x.shape[-1] % 2 == 0:
            return triton_ops.silu_and_mul(x)
        if x.dim() == 2 and x.shape[-1] % 2 == 0 and native.applies(x):
            return native.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
