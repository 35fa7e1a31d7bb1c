"""The experts of a mixture-of-experts block: top-k routing and the fused expert computation.

``select_experts(router_logits, top_k, renormalize)`` is the router's normalisation: a float32
softmax over all experts, the top ``top_k``, renormalised to sum to one where the model says so
(Mixtral always: then the weights are the softmax of the top-k logits; Qwen2/3-MoE where
``norm_topk_prob``).

``FusedMoE`` holds every expert of one block stacked per layer (``w13_weight [E, 2*I, H]``: each
expert's gate rows then its up rows; ``w2_weight [E, H, I]``) and computes

    y[t] = sum_j  w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = topk_ids[t, j]

- on the CPU (and as the oracle): a grouped loop over the experts that received tokens only:
  assignments sorted by expert, one gate_up and one down product per active expert, weighted and
  index-added back (``grouped_experts``);
- on CUDA: the Triton grouped GEMM over assignments sorted by expert, each expert's count padded
  to the block size (``kernels/fused_moe.py``): one kernel for gate_up with SiLU-and-mul in its
  epilogue, one for down with the routing weight in its epilogue, then the sum over the top k; for
  a few assignments (``DeviceTuning.moe_runs_direct``) the same two products as GEMVs over
  the unsorted assignments.

Parallel (``distributed.get_tp_group()``): at one rank every expert is whole. With several ranks
each expert's intermediate dim is split as the dense MLP's (rank ``r`` holds rows ``r*I/tp ..`` of
gate and up and the same columns of down), or, with expert parallel
(``TensorParallelGroup.expert_parallel``, vLLM's ``enable_expert_parallel``), each rank holds
``E/tp`` whole experts and computes their contributions for every token. Either way a rank's output
is a partial sum and ``forward`` all-reduces it (the block's one collective).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group, shard_range
from pagedllm.layers import triton_ops
from pagedllm.layers.custom_op import CustomOp

if TYPE_CHECKING:
    from pagedllm.layers.kernel_plan import KernelPlan

# Checkpoint projections of one expert, by the role they play here.
EXPERT_ROLES = ("gate", "up", "down")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] float32, ids [T, k] int64)``: softmax (float32) over all experts, top
    ``top_k`` (ties to the lower index, as ``torch.topk``), divided by their sum if ``renormalize``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """The experts' weighted sum for ``x [T, H]`` over the local experts ``first_expert ..
    first_expert + E - 1`` (assignments to other experts contribute nothing): per active expert, its
    tokens gathered, ``down(silu(gate) * up)``, times the routing weight (float32, rounded to x's
    dtype), index-added. Cost: two GEMMs per expert that received tokens; a host sync for the
    counts (not capturable in a CUDA graph)."""
    num_local = w13.shape[0]
    top_k = topk_ids.shape[1]
    local_ids = topk_ids.reshape(-1) - first_expert
    weights = topk_weights.reshape(-1)
    kept = ((local_ids >= 0) & (local_ids < num_local)).nonzero().squeeze(1)
    order = kept[torch.argsort(local_ids[kept], stable=True)]
    counts = torch.bincount(local_ids[order], minlength=num_local).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        assignments = order[start:start + count]
        start += count
        tokens = assignments // top_k
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, (y * weights[assignments, None]).to(out.dtype))
    return out


class FusedMoE(CustomOp):
    """The routed experts of one MoE block (module doc): ``forward(x [T, H], router_logits [T, E])
    -> [T, H]`` (summed over the tensor-parallel ranks).

    Parameters (local sizes): ``w13_weight [E_local, 2 * I_local, H]``, ``w2_weight [E_local, H,
    I_local]``, loaded per checkpoint expert through ``weight_loader(param, tensor, (expert,
    role))`` with ``role`` in ``EXPERT_ROLES``; each parameter's ``shard_ids`` lists the
    ``(expert, role)`` pairs it must receive (the model's completeness check). A checkpoint expert
    held by another rank is skipped. Invariant: this rank holds experts ``first_expert ..
    first_expert + num_local_experts - 1``, of each the intermediate rows ``intermediate_start ..
    intermediate_start + intermediate_size - 1`` (all of them under expert parallel).
    Implementations: ``cuda`` (Triton, any CUDA device with Triton: the MoE has no other graph-safe
    form), ``cpu`` and ``native`` (``grouped_experts``)."""

    fuses_kernels = True

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool) -> None:
        super().__init__()
        self.tp = get_tp_group()
        if top_k > num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must not exceed the number of experts ({num_experts})")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.expert_parallel = self.tp.size > 1 and self.tp.expert_parallel
        if self.expert_parallel:
            self.first_expert, self.num_local_experts = shard_range(num_experts, self.tp.rank, self.tp.size,
                                                                    "num_experts (expert parallel)")
            self.intermediate_start, self.intermediate_size = 0, intermediate_size
        else:
            self.first_expert, self.num_local_experts = 0, num_experts
            self.intermediate_start, self.intermediate_size = shard_range(
                intermediate_size, self.tp.rank, self.tp.size, "the experts' intermediate size")
        self.checkpoint_intermediate_size = intermediate_size
        size, local = self.intermediate_size, range(self.first_expert, self.first_expert + self.num_local_experts)
        self.w13_weight = nn.Parameter(torch.empty(self.num_local_experts, 2 * size, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, size), requires_grad=False)
        self.w13_weight.shard_ids = tuple((e, role) for e in local for role in ("gate", "up"))
        self.w2_weight.shard_ids = tuple((e, "down") for e in local)
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        """Copy checkpoint expert ``shard_id = (expert, role)``'s ``[I, H]`` (gate, up) or ``[H, I]``
        (down) matrix into its place (this rank's intermediate slice); other ranks' experts are skipped."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in EXPERT_ROLES):
            raise ValueError(f"expert weights load per (expert, role) shard, got {shard_id!r}")
        expert, role = shard_id
        local = expert - self.first_expert
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is not one of the model's {self.num_experts} experts")
        if not 0 <= local < self.num_local_experts:
            return  # another expert-parallel rank's expert
        hidden, full = self.w2_weight.shape[1], self.checkpoint_intermediate_size
        expected = (hidden, full) if role == "down" else (full, hidden)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"weight shape {tuple(loaded_weight.shape)} does not match expert {role} {expected}")
        size, start = self.intermediate_size, self.intermediate_start
        with torch.no_grad():
            if role == "down":
                param[local].copy_(loaded_weight.narrow(1, start, size))
            else:
                rows = 0 if role == "gate" else size
                param[local, rows:rows + size].copy_(loaded_weight.narrow(0, start, size))

    def choose_impl(self, plan: KernelPlan) -> str:
        if plan.device.type == "cuda":
            return "cuda" if triton_ops.HAS_TRITON else "native"
        return "cpu" if plan.device.type == "cpu" else "native"

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self._forward(x, router_logits))

    def forward_native(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        return grouped_experts(x, self.w13_weight, self.w2_weight, weights, ids, self.first_expert)

    def forward_cpu(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.forward_native(x, router_logits)

    def forward_cuda(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if not (triton_ops.fusable(x) and x.dim() == 2 and x.dtype == self.w13_weight.dtype):
            return self.forward_native(x, router_logits)
        from pagedllm.layers.kernels.fused_moe import fused_experts, fused_experts_direct

        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.tuning.moe_runs_direct(x.shape[0] * self.top_k, self.num_local_experts):
            return fused_experts_direct(x, self.w13_weight, self.w2_weight, weights, ids, self.first_expert,
                                        self.tuning.moe_gemv_config)
        return fused_experts(x, self.w13_weight, self.w2_weight, weights, ids, self.first_expert, self.expert_parallel,
                             self.tuning.moe_gemm_config(x.shape[0] * self.top_k, self.num_local_experts))

    def extra_repr(self) -> str:
        return (f"experts={self.first_expert}..{self.first_expert + self.num_local_experts - 1} of "
                f"{self.num_experts}, top_k={self.top_k}, intermediate={self.intermediate_size}, "
                f"renormalize={self.renormalize}")
