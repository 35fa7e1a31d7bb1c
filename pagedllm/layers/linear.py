"""Linear layers whose parameters know how to load checkpoint shards.

Every parameter gets a ``weight_loader(param, loaded_weight, shard_id)``. Merged layers stack several
checkpoint matrices along the output dim (one GEMM instead of three / two) and record their shard ids
in ``param.shard_ids`` so the model can check that every shard was loaded. Single-device for now: a
tensor-parallel version would split the output (column) or input (row) dim inside these loaders.
Weights are allocated with ``torch.empty``: they are meant to be loaded (or dummy-initialized).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pagedllm.layers import cpu_gemm, gemm_library, triton_ops


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"weight shape {tuple(loaded_weight.shape)} does not match parameter {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded_weight)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with W ``[out_features, in_features]``, loaded from one checkpoint tensor."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        for p in self.parameters():
            p.weight_loader = self.weight_loader
        # oneDNN-blocked copy of ``weight`` for the CPU (``pack_cpu_weight``); None: not packed.
        self.cpu_packed_weight: torch.Tensor | None = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, loaded_weight)

    def pack_cpu_weight(self) -> bool:
        """Make the prepacked CPU copy (``cpu_gemm``); call once the weights are final (a later
        change to ``weight`` is not seen by the packed copy)."""
        self.cpu_packed_weight = cpu_gemm.pack_weight(self.weight)
        return self.cpu_packed_weight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """cuBLAS or cuBLASLt (``gemm_library``: whichever start-up timed faster for this shape and
        row count), or on CUDA at 1-2 rows the Triton GEMV where it is faster
        (``triton_ops.use_skinny_gemm``); on the CPU the prepacked oneDNN GEMM once packed."""
        if self.cpu_packed_weight is not None and x.device.type == "cpu" and x.dtype == self.weight.dtype:
            return cpu_gemm.packed_linear(x, self.cpu_packed_weight, self.bias)
        if triton_ops.use_skinny_gemm(x, self.weight):
            return triton_ops.skinny_linear(x, self.weight, self.bias)
        return gemm_library.linear(x, self.weight, self.bias)

    def forward_add_(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual += self(x)``, in place; returns ``residual``. On CUDA, without a bias and where
        cuBLAS runs the layer, one GEMM with the add in its epilogue (``gemm_library.linear_add_``);
        elsewhere the two ops."""
        if self.bias is None and x.is_cuda and x.dim() == 2 and not triton_ops.use_skinny_gemm(x, self.weight):
            return gemm_library.linear_add_(x, self.weight, residual)
        return residual.add_(self(x))


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim, e.g. gate_up_proj =
    [gate_proj; up_proj]. Shard ``i`` (an index or a name from ``shard_names``) fills rows
    ``offsets[i] : offsets[i] + output_sizes[i]``."""

    def __init__(
        self, in_features: int, output_sizes: Sequence[int], bias: bool = False, shard_names: Sequence = ()
    ) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.shard_names = list(shard_names) or list(range(len(output_sizes)))
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(output_sizes))]
        for p in self.parameters():
            p.shard_ids = tuple(self.shard_names)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:  # a checkpoint that already stores the merged tensor
            default_weight_loader(param, loaded_weight)
            return
        i = self.shard_names.index(shard_id)
        default_weight_loader(param.narrow(0, self.offsets[i], self.output_sizes[i]), loaded_weight)


class QKVLinear(MergedLinear):
    """q, k and v projections in one GEMM: output ``[T, (H + 2*Hkv) * D]``, shards "q", "k", "v"."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias, shard_names=("q", "k", "v"))
        self.q_size, self.kv_size = q_size, kv_size
