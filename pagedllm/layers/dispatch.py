"""What the runner does to a loaded model before serving: one call, one plan per engine.

``prepare_model_kernels(model, device, kernel_config)``:

1. folds the decoder norms into the projections after them (``compound.fold_norms``) where allowed
   (CUDA and ``kernel_config.fold_norms``), and with the fused kernels on enables the residual-stream
   form from the tuning row's ``residual_stream_min_tokens`` rows (``layers/residual.py``);
2. on the CPU prepacks the linear weights for oneDNN (``cpu_gemm``), once they are final;
3. chooses every ``CustomOp``'s implementation once (``CustomOp.select``: native / cpu / cuda),
   from the kernel config and the device's tuning row (``layers/tuning.py``).

It returns the engine's ``KernelPlan``: the choices made, and the cuBLAS / cuBLASLt table that its
CUDA linear layers share, which ``KernelPlan.tune_gemms`` fills at start-up before the CUDA graphs
capture it. Nothing is process-global: two engines in one process have two plans.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from pagedllm.config import KernelConfig
from pagedllm.layers import cpu_gemm, triton_ops
from pagedllm.layers.compound import fold_norms, use_residual_stream
from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.embedding import LMHead
from pagedllm.layers.gemm_library import GemmLibrary
from pagedllm.layers.linear import Linear
from pagedllm.layers.tuning import DeviceTuning, for_device

logger = logging.getLogger("pagedllm")


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
        modules = [m for m in model.modules() if isinstance(m, (Linear, LMHead))]
        head_shapes = {m.weight.shape for m in modules if isinstance(m, LMHead)}

        def takes_triton_gemv(x: torch.Tensor, w: torch.Tensor) -> bool:
            return self.fused_kernels and (triton_ops.skinny_gemm_fits(x, w, self.tuning) or (
                w.shape in head_shapes and triton_ops.skinny_lm_head_fits(x, w)))

        with torch.inference_mode():
            return self.gemms.tune([m.weight for m in modules], batch_sizes, skip=takes_triton_gemv)


def prepare_model_kernels(model: nn.Module, device: torch.device, kernel_config: KernelConfig) -> KernelPlan:
    """Fold norms (CUDA), prepack CPU weights and choose every op's implementation (module doc)."""
    device = torch.device(device)
    tuning = for_device(device)
    plan = KernelPlan(device, kernel_config, tuning, GemmLibrary(tuning.cublaslt_margin))
    if device.type == "cuda" and kernel_config.fold_norms:
        plan.norms_folded = fold_norms(model)
        logger.debug("norm weights %s into the projections", "folded" if plan.norms_folded else "not folded")
    use_residual_stream(model, tuning.residual_stream_min_tokens if plan.norms_folded and plan.fused_kernels
                        else None)
    if device.type == "cpu":
        plan.packed_weights = cpu_gemm.pack_linear_weights(model)
        logger.debug("prepacked %d linear weights for the CPU", plan.packed_weights)
    for name, module in model.named_modules():
        if isinstance(module, CustomOp):
            plan.impls[name] = module.select(plan)
    return plan
