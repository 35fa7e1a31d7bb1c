"""``KernelPlan``: the kernel choices of one engine on one device (made by ``dispatch.py``).

A plain record the ops read when they choose their implementation; it imports no op module, so
every op can name it. Modules whose weight goes through cuBLAS say so with ``gemm_tunable = True``
(the LM head also with ``is_lm_head = True``), which is how ``tune_gemms`` finds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pagedllm.config import KernelConfig
from pagedllm.layers import triton_ops
from pagedllm.layers.gemm_library import GemmLibrary
from pagedllm.layers.tuning import DeviceTuning


@dataclass
class KernelPlan:
    """The kernel choices of one engine on one device.

    ``impls`` maps each ``CustomOp``'s module name to its chosen implementation; ``gemms`` is the
    cuBLAS / cuBLASLt table of the CUDA linear layers (empty until ``tune_gemms``)."""

    device: torch.device
    config: KernelConfig
    tuning: DeviceTuning
    gemms: GemmLibrary
    impls: dict[str, str] = field(default_factory=dict)
    norms_folded: bool = False
    packed_weights: int = 0

    @property
    def fused_kernels(self) -> bool:
        """Whether the fused Triton kernels run: a CUDA device, ``KernelConfig.fused_ops``, Triton installed."""
        return self.device.type == "cuda" and self.config.fused_ops and triton_ops.HAS_TRITON

    def tune_gemms(self, model: nn.Module, batch_sizes: list[int]) -> dict:
        """Time cuBLAS against cuBLASLt on the model's linear and LM-head weights at each CUDA-graph
        batch size (``GemmLibrary.tune``) and keep the faster per shape; calls that never reach cuBLAS
        (the Triton GEMVs) are not timed. Returns the summary for the log; a no-op (nothing measured)
        when ``KernelConfig.gemm_tuning`` is off or the device is not CUDA."""
        if not self.config.gemm_tuning or self.device.type != "cuda":
            return {"measured": 0, "cublaslt": 0, "seconds": 0.0}
        modules = [m for m in model.modules() if getattr(m, "gemm_tunable", False)]
        head_shapes = {m.weight.shape for m in modules if getattr(m, "is_lm_head", False)}

        def takes_triton_gemv(x: torch.Tensor, w: torch.Tensor) -> bool:
            return self.fused_kernels and (triton_ops.skinny_gemm_fits(x, w, self.tuning) or (
                w.shape in head_shapes and triton_ops.skinny_lm_head_fits(x, w)))

        with torch.inference_mode():
            return self.gemms.tune([m.weight for m in modules], batch_sizes, skip=takes_triton_gemv)
