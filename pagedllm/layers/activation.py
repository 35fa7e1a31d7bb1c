"""Gated activation for merged gate/up projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers import triton_ops
from pagedllm.layers.norm import rms_scale
from pagedllm.native import kernels as native


class SiluAndMul(nn.Module):
    """``x = [gate | up]`` (last dim 2*I) -> ``silu(gate) * up`` (last dim I).

    Cost: on CUDA one fused Triton launch (reads 2*I, writes I per row); on the CPU in float32 the same
    pass in C (``native.silu_and_mul``); elsewhere two torch ops.
    """

    def forward(self, x: torch.Tensor, row_scale: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """``row_scale = (s, eps)``: scale gate and up by each row's RMS of ``s`` first
        (``norm.rms_scale``; one launch with it on CUDA)."""
        if (triton_ops.use_fused(x) and x.shape[-1] % 2 == 0
                and (row_scale is None or (x.dim() == 2 and triton_ops.row_scale_fits(x, row_scale)))):
            return triton_ops.silu_and_mul(x, row_scale)
        if row_scale is not None:
            x = rms_scale(x, *row_scale)
        if x.dim() == 2 and x.shape[-1] % 2 == 0 and native.applies(x):
            return native.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
