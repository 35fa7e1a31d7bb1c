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

import torch
from torch import nn

from pagedllm.config import KernelConfig
from pagedllm.layers import cpu_gemm
from pagedllm.layers.compound import fold_norms, use_residual_stream
from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.gemm_library import GemmLibrary
from pagedllm.layers.kernel_plan import KernelPlan
from pagedllm.layers.tuning import for_device

logger = logging.getLogger("pagedllm")


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
