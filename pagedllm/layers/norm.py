"""RMSNorm with an optional fused residual add (the pattern every pre-norm decoder layer uses)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers import triton_ops
from pagedllm.layers.custom_op import CustomOp
from pagedllm.native import kernels as native


class RMSNorm(CustomOp):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32 and cast back (as HF does).

    ``forward(x)`` returns the normed tensor. ``forward(x, residual)`` first adds ``residual`` (in the
    input dtype, as HF's ``residual + hidden_states``) and returns ``(normed, x + residual)`` so the
    caller carries the new residual stream to the next layer.

    Cost: CUDA, one fused Triton launch (``triton_ops.rms_norm``: reads x and residual, writes the
    normed row and the new residual, once each); CPU in float32, the same single pass in C
    (``native.rms_norm``) for 2-D inputs; native, the torch ops of ``forward_native`` (the oracle).
    """

    fuses_kernels = True

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dim() == 2 and native.applies(x, self.weight, *(() if residual is None else (residual,))):
            return native.rms_norm(x, self.weight, self.eps, residual)
        return self.forward_native(x, residual)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if triton_ops.fusable(x) and (residual is None or residual.dtype == x.dtype):
            return triton_ops.rms_norm(x, self.weight, self.eps, residual)
        return self.forward_native(x, residual)


def rms_scale(y: torch.Tensor, s: torch.Tensor, eps: float) -> torch.Tensor:
    """``y`` with each row multiplied by ``1 / sqrt(mean(s_row^2) + eps)`` of the same row of ``s``
    (float32, rounded to y's dtype): the RMSNorm of ``s`` applied after a linear layer instead of
    before it. ``linear(rmsnorm(s) * g) == rms_scale(linear'(s), s, eps)`` when ``linear'`` holds
    ``W * g`` and has no bias (the residual-stream form, ``layers/residual.py``). The fused kernels
    take the same scale as ``row_scale=(s, eps)``."""
    rstd = torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + eps)
    return (y.float() * rstd).to(y.dtype)
