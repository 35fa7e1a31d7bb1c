"""Per-device thresholds that choose among the allowed kernels, in one table.

Every number the layers use to pick a kernel for a shape lives in ``DeviceTuning``; ``for_device``
gives the row for a device. There is one measured row, ``HOPPER`` (measured on H200 GPUs with the
benchmarks in ``benchmarks/kernels/``; the figures are in ``benchmarks/results/``). Every other GPU
(and the CPU, where only ``residual_stream_min_tokens`` can matter) uses it too until someone
measures that GPU and adds its row here: the choices stay correct on any device, only possibly
slower than the best ones there.

Which kernel families may run at all is the engine's ``KernelConfig`` (``pagedllm/config.py``);
this table only chooses among the allowed ones.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceTuning:
    """The kernel-choice thresholds of one kind of device (see the module doc for where they come
    from). Immutable: a KernelPlan and every module it prepares share the same row."""

    # The residual-stream forward (norms folded into the projections after them) from this many
    # token rows up: below it the decode GEMVs take the norm and activation in their prologues, and
    # the narrow projections at two rows are GEMVs, which have no residual-add epilogue.
    residual_stream_min_tokens: int = 3
    # The Triton weight-streaming GEMV instead of cuBLAS: at one row for weights up to this many
    # elements, and at two rows for narrow outputs (N <= skinny_narrow_n and K >= 2N), where cuBLAS
    # has too few column tiles to fill the GPU. At 3+ rows cuBLAS wins or ties.
    skinny_max_weight_elements: int = 128 * 2**20
    skinny_narrow_n: int = 1024
    # The LM head at one row takes the Triton GEMV with these launch parameters
    # ``(block_n, block_k, num_warps)``: cuBLAS also zeroes a workspace before it. At 2+ rows cuBLAS wins.
    lm_head_gemv_config: tuple[int, int, int] = (32, 512, 4)
    # GEMV launch parameters by weight size (``kernels/skinny_gemm.launch_config``): above
    # ``gemv_large_weight_elements`` wider column blocks stream best; from
    # ``gemv_medium_weight_elements`` 8-column blocks beat the default grid.
    gemv_large_weight_elements: int = 32 * 2**20
    gemv_medium_weight_elements: int = 16 * 2**20
    # cuBLASLt is chosen for a (shape, rows) pair when start-up timed it below
    # ``(1 - cublaslt_margin)`` times cuBLAS (``gemm_library.GemmLibrary.tune``).
    cublaslt_margin: float = 0.03
    # Fused-MoE grouped GEMM launch parameters ``(block_m, block_n, block_k, group_m, num_warps,
    # num_stages)`` (``kernels/fused_moe.py``) by the mean assignments per expert (tokens x top_k /
    # experts): up to the first bound, narrow column blocks (at decode of a few tokens only the
    # active experts' blocks run: more programs to stream their weights); then 16-row blocks; then
    # 64-row blocks (prefill). The published fused-MoE designs' defaults; not yet measured here.
    # Up to this many assignments (tokens x top_k) per expert on average the experts run as GEMVs
    # over the unsorted assignments (``kernels/fused_moe.fused_experts_direct``), with ``(block_n,
    # block_k, num_warps)``: at decode of a few tokens sorting and padding cost more launches than
    # the GEMMs save. Measured on an H100 (``benchmarks/kernels/bench_fused_moe.py``, routing +
    # experts): Qwen3-30B-A3B 1 token 62 vs 120 us, 16 tokens 316 vs 338, 32: 505 vs 467; Mixtral
    # 2 tokens 522 vs 556, 4: 703 vs 674.
    moe_gemv_max_per_expert: float = 1.0
    moe_gemv_config: tuple[int, int, int] = (16, 256, 4)
    moe_gemm_configs: tuple[tuple[float, tuple[int, int, int, int, int, int]], ...] = (
        (1.0, (16, 32, 128, 1, 4, 4)),
        (16.0, (16, 64, 128, 1, 4, 3)),
        (float("inf"), (64, 64, 64, 8, 4, 3)),
    )

    def moe_runs_direct(self, num_assignments: int, num_experts: int) -> bool:
        """Whether ``num_assignments`` (tokens x top_k) over ``num_experts`` take the direct GEMVs."""
        return num_assignments <= self.moe_gemv_max_per_expert * num_experts

    def moe_gemm_config(self, num_assignments: int, num_experts: int) -> tuple[int, int, int, int, int, int]:
        """The fused-MoE launch parameters for ``num_assignments`` (tokens x top_k) over ``num_experts``."""
        per_expert = num_assignments / num_experts
        return next(config for bound, config in self.moe_gemm_configs if per_expert <= bound)


HOPPER = DeviceTuning()


@functools.lru_cache(maxsize=16)
def for_device(device: torch.device | str) -> DeviceTuning:
    """The tuning row for ``device``. Only ``HOPPER`` is measured; every device gets it for now."""
    return HOPPER
