"""Token embedding and the LM head (optionally tied to the embedding)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group, shard_range
from pagedllm.layers import cpu_gemm, triton_ops
from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.linear import default_weight_loader

if TYPE_CHECKING:
    from pagedllm.layers.gemm_library import GemmLibrary
    from pagedllm.layers.kernel_plan import KernelPlan


class VocabEmbedding(CustomOp):
    """``[T] token ids -> [T, hidden]``: one gather (``F.embedding``) on every device.

    Vocabulary-parallel: rank ``r`` of the tensor-parallel group holds rows ``vocab_start :
    vocab_start + V/tp`` of the table; an id outside them gives zeros there, and the ranks' rows are
    summed (one all-reduce). At one rank, the plain gather. Invariant: ``weight`` is the local
    slice; ``vocab_size`` the whole vocabulary."""

    fuses_kernels = True

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = get_tp_group()
        self.vocab_start, local = shard_range(vocab_size, self.tp.rank, self.tp.size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(local, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.quant_method = None  # a ``pagedllm.quantization`` method (GGUF), or None: the float table

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, loaded_weight.narrow(0, self.vocab_start, param.shape[0]))

    def choose_impl(self, plan: KernelPlan) -> str:
        return "quantized" if self.quant_method is not None else super().choose_impl(plan)

    def forward_quantized(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._vocab_parallel(input_ids, lambda ids: self.quant_method.embedding(self, ids))

    def forward_native(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._vocab_parallel(input_ids, lambda ids: F.embedding(ids, self.weight))

    def _vocab_parallel(self, input_ids: torch.Tensor, gather) -> torch.Tensor:
        """``gather(ids)`` of the local table; with several ranks, ids outside this rank's rows give
        zeros and the ranks' rows are summed."""
        if self.tp.size == 1:
            return gather(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_size // self.tp.size)
        rows = gather(local.masked_fill(outside, 0))
        return self.tp.all_reduce(rows.masked_fill_(outside.unsqueeze(-1), 0))


class LMHead(CustomOp):
    """``[N, hidden] -> [N, vocab]`` logits in float32 (computed in the model dtype, then upcast, as HF;
    ``upcast=False`` leaves them in the model dtype: one kernel and a vocab-wide copy fewer per step,
    for a consumer that upcasts itself, like the sampler).

    With ``tied_to`` the head shares the embedding's weight: one Parameter, loaded once.
    Vocabulary-parallel like ``VocabEmbedding``: each rank computes the logits of its slice of the
    vocabulary and they are gathered (one all-gather) so that every rank's sampler sees them all.
    Implementations as ``Linear``'s: ``cuda`` (at one row the Triton GEMV with the tuning row's
    ``lm_head_gemv_config``, else the plan's cuBLAS / cuBLASLt choice), ``cublas``, ``cpu`` (oneDNN
    once packed), ``native``. Timed by ``KernelPlan.tune_gemms`` like a ``Linear``.
    """

    fuses_kernels = True
    gemm_tunable = True
    is_lm_head = True

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.tied = tied_to is not None
        self.tp = get_tp_group()
        self.vocab_start, local = shard_range(vocab_size, self.tp.rank, self.tp.size, "vocab_size")
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(local, hidden_size), requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        self.cpu_packed_weight: torch.Tensor | None = None  # as in ``Linear``: the oneDNN-blocked copy
        self.gemms: GemmLibrary | None = None
        self.quant_method = None  # a ``pagedllm.quantization`` method (GGUF), or None: the float head

    def choose_impl(self, plan: KernelPlan) -> str:
        if self.quant_method is not None:
            return "quantized"
        if plan.device.type == "cuda":
            self.gemms = plan.gemms
            return "cuda" if plan.fused_kernels else "cublas"
        return "cpu" if plan.device.type == "cpu" else "native"

    def pack_cpu_weight(self) -> bool:
        """Prepack the head for the CPU (``cpu_gemm``): a tied head gets its own packed copy."""
        if self.quant_method is not None:
            return False
        self.cpu_packed_weight = cpu_gemm.pack_weight(self.weight)
        return self.cpu_packed_weight is not None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, loaded_weight.narrow(0, self.vocab_start, param.shape[0]))

    def forward(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = self.tp.all_gather(self._forward(hidden), dim=-1)
        return logits.float() if upcast else logits

    def forward_native(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)

    def forward_quantized(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, hidden, None)

    def forward_cpu(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.cpu_packed_weight is not None and hidden.device.type == "cpu" and hidden.dtype == self.weight.dtype:
            return cpu_gemm.packed_linear(hidden, self.cpu_packed_weight, None)
        return F.linear(hidden, self.weight)

    def forward_cublas(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gemms.linear(hidden, self.weight)

    def forward_cuda(self, hidden: torch.Tensor) -> torch.Tensor:
        if triton_ops.skinny_lm_head_fits(hidden, self.weight):
            return triton_ops.lm_head_linear(hidden, self.weight, self.tuning)
        return self.gemms.linear(hidden, self.weight)
