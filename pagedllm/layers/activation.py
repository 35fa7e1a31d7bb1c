"""Gated activations for merged gate/up projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers import triton_ops
from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.norm import rms_scale
from pagedllm.native import kernels as native


class SiluAndMul(CustomOp):
    """``x = [gate | up]`` (last dim 2*I) -> ``silu(gate) * up`` (last dim I).

    ``forward(x, row_scale=None)``; ``row_scale = (s, eps)``: scale gate and up by each row's RMS of
    ``s`` first (``norm.rms_scale``; the residual-stream form's pending norm).
    Cost: CUDA, one fused Triton launch (reads 2*I, writes I per row; the row scale in the same
    launch); CPU in float32, the same pass in C (``native.silu_and_mul``); native, two torch ops.
    """

    fuses_kernels = True

    def forward_native(self, x: torch.Tensor, row_scale: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        if row_scale is not None:
            x = rms_scale(x, *row_scale)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, x: torch.Tensor, row_scale: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        if row_scale is not None:
            x = rms_scale(x, *row_scale)
        if x.dim() == 2 and x.shape[-1] % 2 == 0 and native.applies(x):
            return native.silu_and_mul(x)
        return self.forward_native(x)

    def forward_cuda(self, x: torch.Tensor, row_scale: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        if (triton_ops.fusable(x) and x.shape[-1] % 2 == 0
                and (row_scale is None or (x.dim() == 2 and triton_ops.row_scale_fits(x, row_scale)))):
            return triton_ops.silu_and_mul(x, row_scale)
        return self.forward_native(x, row_scale)


class GeluTanhAndMul(CustomOp):
    """``x = [gate | up]`` (last dim 2*I) -> ``gelu_tanh(gate) * up`` (last dim I): Gemma's MLP
    (``gelu_pytorch_tanh``). Cost: two torch ops on every device (``forward_native``)."""

    fuses_kernels = True

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
