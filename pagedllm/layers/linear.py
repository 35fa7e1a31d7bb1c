"""Linear layers whose parameters know how to load checkpoint shards.

Every parameter gets a ``weight_loader(param, loaded_weight, shard_id)``. Merged layers stack several
checkpoint matrices along the output dim (one GEMM instead of three / two) and record their shard ids
in ``param.shard_ids`` so the model can check that every shard was loaded. Single-device for now: a
tensor-parallel version would split the output (column) or input (row) dim inside these loaders.
Weights are allocated with ``torch.empty``: they are meant to be loaded (or dummy-initialized).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group, shard_range
from pagedllm.layers import cpu_gemm, triton_ops
from pagedllm.layers.custom_op import CustomOp

if TYPE_CHECKING:
    from pagedllm.layers.gemm_library import GemmLibrary
    from pagedllm.layers.kernel_plan import KernelPlan
    from pagedllm.layers.norm import RMSNorm


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"weight shape {tuple(loaded_weight.shape)} does not match parameter {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded_weight)


class Linear(CustomOp):
    """``y = x W^T (+ b)`` with W ``[out_features, in_features]``, loaded from one checkpoint tensor.

    Implementations: ``cuda`` (the Triton GEMV at 1-2 rows where the device's tuning row says it
    beats cuBLAS, else cuBLAS / cuBLASLt as the plan's ``GemmLibrary`` timed faster for the shape),
    ``cublas`` (CUDA without the fused kernels: the library choice only), ``cpu`` (oneDNN with the
    prepacked weight once ``pack_cpu_weight`` ran, else ``F.linear``), ``native`` (``F.linear``).

    Fused methods, for the compound modules of ``layers/compound.py``; each returns None (or, for
    ``forward_add_``, runs the two ops) where its kernel does not apply, so a caller can always fall
    back to ``forward``: ``forward_norm_prologue`` (residual add + RMSNorm in the GEMV's prologue),
    ``forward_act_prologue`` (SiLU-and-mul in the GEMV's prologue), ``forward_add_`` (the residual
    add in the GEMM's epilogue), and the load-time ``fold_input_scale_``. A subclass that computes
    something else than ``F.linear(x, self.weight, self.bias)`` (LoRA, quantized) sets
    ``fuses_kernels = False`` (automatic when it overrides ``forward`` or an implementation) and the
    fused methods then run its plain ``forward``. ``gemm_tunable``: its weight goes through the
    plan's cuBLAS / cuBLASLt table (``KernelPlan.tune_gemms`` times it).

    Quantized: ``set_quant_method`` (``pagedllm.quantization``) hands the layer to a scheme's
    ``QuantizeMethodBase``, which creates, loads and processes its parameters and computes the
    product (``apply``); the layer then runs the ``quantized`` implementation on every device, says
    ``fuses_kernels = False`` and ``gemm_tunable = False`` (instance attributes: its weight is no
    float matrix for the fused kernels or the cuBLAS table) and is neither prepacked nor folded; its
    ``forward_norm_prologue`` / ``forward_act_prologue`` (and ``QKVLinear.forward_norm_rope_store``)
    run the method's own fused kernels where it has them (``apply_norm_prologue`` /
    ``apply_act_prologue`` / ``apply_norm_qkv_rope_store``) and the plan allows fused kernels.
    ``quant_method`` None: the plain layer above, unchanged.

    LoRA (``pagedllm.lora``): ``lora`` is None (no LoRA: nothing allocated) or the layer's stacked
    adapter matrices (``lora.layers.LoRALinearWeights``). ``set_lora_active(True)`` makes every
    call run ``forward_lora``, the implementation chosen at load plus each token's adapter delta,
    with ``fuses_kernels = False`` so that no fused kernel bypasses it (except ``forward_add_``'s
    GEMM with the residual add, after which the delta goes into the sum); ``set_lora_active(False)``
    restores the implementation and the fused kernels of the plain layer.
    """

    fuses_kernels = True
    gemm_tunable = True

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
        self.gemms: GemmLibrary | None = None  # the plan's cuBLAS / cuBLASLt table (CUDA)
        self.quantized_fusions = False  # a quantized layer's fused methods may run (fused / C kernels on)
        # A ``pagedllm.quantization`` ``QuantizeMethodBase`` (not imported: quantization sits above
        # layers and imports them), or None: the plain layer.
        self.quant_method = None
        self.lora = None  # a pagedllm.lora LoRALinearWeights, or None (not imported: lora sits above layers)
        self._impl_without_lora: str | None = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, self.checkpoint_slice(loaded_weight, shard_id))

    def checkpoint_slice(self, loaded_weight: torch.Tensor, shard_id: object = None) -> torch.Tensor:
        """This rank's part of a checkpoint tensor (of shard ``shard_id``, for a merged layer), taken
        with ``loaded_weight.narrow`` only, so a lazy checkpoint tensor reads just that part (the
        loaders of quantized schemes call it too). Here the whole tensor: the layer is replicated."""
        return loaded_weight

    def choose_impl(self, plan: KernelPlan) -> str:
        """``cuda`` or ``cublas`` on CUDA (with or without the Triton GEMV), ``cpu`` on the CPU (the
        oneDNN GEMM is no C kernel of ours: ``KernelConfig.cpu_kernels`` does not turn it off);
        ``quantized`` on every device for a quantized layer."""
        if self.quant_method is not None:  # fused methods: CUDA's Triton kernels, or the CPU's C kernels
            self.quantized_fusions = (plan.fused_kernels if plan.device.type == "cuda"
                                      else plan.device.type == "cpu" and plan.config.cpu_kernels)
            return "quantized"
        if plan.device.type == "cuda":
            self.gemms = plan.gemms
            return "cuda" if plan.fused_kernels else "cublas"
        return "cpu" if plan.device.type == "cpu" else "native"

    def pack_cpu_weight(self) -> bool:
        """Make the prepacked CPU copy (``cpu_gemm``); call once the weights are final (a later
        change to ``weight`` is not seen by the packed copy). A quantized layer is not packed."""
        if self.quant_method is not None:
            return False
        self.cpu_packed_weight = cpu_gemm.pack_weight(self.weight)
        return self.cpu_packed_weight is not None

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def set_lora_active(self, active: bool) -> None:
        """Add the LoRA delta to every call from now on (``active``), or stop (see the class doc).
        Precondition: ``lora`` is set; the LoRA manager calls this only when the state changes."""
        if active:
            self._impl_without_lora = self.impl
            self._fuses_without_lora = self.__dict__.get("fuses_kernels")
            self.fuses_kernels = False
            self.use_impl("lora")
        else:
            self.use_impl(self._impl_without_lora)
            if self._fuses_without_lora is None:
                del self.fuses_kernels  # the class's value again
            else:
                self.fuses_kernels = self._fuses_without_lora

    def forward_lora(self, x: torch.Tensor) -> torch.Tensor:
        y = getattr(self, f"forward_{self._impl_without_lora}")(x)
        return self.lora.apply(x, y)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_packed_weight is not None and x.device.type == "cpu" and x.dtype == self.weight.dtype:
            return cpu_gemm.packed_linear(x, self.cpu_packed_weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def forward_cublas(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemms.linear(x, self.weight, self.bias)

    def forward_quantized(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        if triton_ops.skinny_gemm_fits(x, self.weight, self.tuning):
            return triton_ops.skinny_linear(x, self.weight, self.bias)
        return self.gemms.linear(x, self.weight, self.bias)

    def _fused(self) -> bool:
        return self.impl == "cuda" and self.fuses_kernels

    def _quantized_fusion(self, name: str):
        """The quantization method's fused method ``name`` (``apply_norm_prologue(layer, x, residual,
        norm)`` / ``apply_act_prologue(layer, x)``, each returning None where its kernel does not
        apply), where the layer runs quantized and the plan allows fused kernels; else None."""
        if self.impl != "quantized" or not self.quantized_fusions:
            return None
        return getattr(self.quant_method, name, None)

    def forward_add_(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual += self(x)``, in place; returns ``residual``. On CUDA, without a bias and where
        cuBLAS runs the layer, one GEMM with the add in its epilogue (``GemmLibrary.linear_add_``);
        elsewhere the two ops."""
        impl, fuses = self.impl, self.fuses_kernels
        if impl == "lora":  # the plain layer's add (fused where it applies), then the delta into the sum
            impl = self._impl_without_lora
            fuses = type(self).fuses_kernels if self._fuses_without_lora is None else self._fuses_without_lora
        if (impl in ("cuda", "cublas") and fuses and self.bias is None and x.is_cuda
                and x.dim() == 2 and not (impl == "cuda" and triton_ops.skinny_gemm_fits(x, self.weight, self.tuning))):
            self.gemms.linear_add_(x, self.weight, residual)
            return self.lora.apply(x, residual) if self.impl == "lora" else residual
        return residual.add_(self(x))

    def forward_norm_prologue(self, x: torch.Tensor, residual: torch.Tensor | None,
                              norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(self(norm(x + residual)), x + residual)`` in one launch (the GEMV with the residual add
        and the norm in its prologue; without a residual ``(self(norm(x)), x)``), or None where that
        kernel does not apply (it applies exactly where ``forward`` takes the Triton GEMV)."""
        quantized = self._quantized_fusion("apply_norm_prologue")
        if quantized is not None:
            return quantized(self, x, residual, norm) if norm.fuses_kernels else None
        if not (self._fused() and norm.fuses_kernels
                and triton_ops.norm_prologue_fits(x, residual, norm.weight, self.weight, self.tuning)):
            return None
        return triton_ops.rms_norm_linear(x, residual, norm.weight, norm.eps, self.weight, self.bias)

    def forward_act_prologue(self, x: torch.Tensor) -> torch.Tensor | None:
        """``self(silu(gate) * up)`` for ``x = [gate | up]`` in one launch (the GEMV with the activation
        in its prologue), or None where that kernel does not apply."""
        quantized = self._quantized_fusion("apply_act_prologue")
        if quantized is not None:
            return quantized(self, x)
        if not (self._fused() and triton_ops.act_prologue_fits(x, self.weight, self.tuning)):
            return None
        return triton_ops.silu_and_mul_linear(x, self.weight, self.bias)

    def can_fold_input_scale(self) -> bool:
        """Whether ``fold_input_scale_`` can move a per-input-column scale into this layer: no bias
        (the scale would have to go between the product and the bias) and a plain linear."""
        return self.bias is None and self.fuses_kernels

    @torch.no_grad()
    def fold_input_scale_(self, scale: torch.Tensor) -> None:
        """``W[:, k] *= scale[k]`` in float32, rounded to W's dtype (load time: norm folding). Call
        before ``pack_cpu_weight``. Precondition: ``can_fold_input_scale()``."""
        self.weight.copy_(self.weight.float() * scale.float()[None, :])


class ColumnParallelLinear(Linear):
    """A ``Linear`` whose output dim is split across the tensor-parallel ranks: rank ``r`` holds rows
    ``r * N/tp : (r+1) * N/tp`` of W and of the bias and computes that slice of the output (no
    collective: the next layer is row-parallel, or the caller gathers). At one rank it is a
    ``Linear``. Invariant: ``out_features`` is the local slice's size."""

    fuses_kernels = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp = get_tp_group()
        self.output_start, local = shard_range(out_features, self.tp.rank, self.tp.size, "output features")
        super().__init__(in_features, local, bias)

    def checkpoint_slice(self, loaded_weight: torch.Tensor, shard_id: object = None) -> torch.Tensor:
        return loaded_weight.narrow(0, self.output_start, self.out_features)


class RowParallelLinear(Linear):
    """A ``Linear`` whose input dim is split across the tensor-parallel ranks: rank ``r`` holds
    columns ``r * K/tp : (r+1) * K/tp`` of W, multiplies its slice of the input, and the partial
    products are summed over the ranks (``TensorParallelGroup.all_reduce``) in ``forward`` and in
    every fused method, before any residual add. The bias is loaded on rank 0 only (zeros
    elsewhere), so the sum adds it once and each rank runs the same kernels as an unsharded layer.
    At one rank it is a ``Linear`` (no collective). Invariant: ``in_features`` is the local slice."""

    fuses_kernels = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp = get_tp_group()
        self.input_start, local = shard_range(in_features, self.tp.rank, self.tp.size, "input features")
        super().__init__(local, out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if param.dim() == 2:
            default_weight_loader(param, self.checkpoint_slice(loaded_weight))
        elif self.tp.rank == 0:
            default_weight_loader(param, loaded_weight)
        else:
            with torch.no_grad():
                param.zero_()

    def checkpoint_slice(self, loaded_weight: torch.Tensor, shard_id: object = None) -> torch.Tensor:
        """The weight's columns of this rank (a bias is not split: rank 0 loads it whole)."""
        return loaded_weight.narrow(1, self.input_start, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self._forward(x))

    def forward_add_(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward_add_(x, residual)
        return residual.add_(self(x))

    def forward_act_prologue(self, x: torch.Tensor) -> torch.Tensor | None:
        y = super().forward_act_prologue(x)
        return y if y is None else self.tp.all_reduce(y)

    def forward_norm_prologue(self, x, residual, norm):
        if self.tp.size > 1:  # the norm reads the whole row; this layer holds a slice of it
            return None
        return super().forward_norm_prologue(x, residual, norm)

    def can_fold_input_scale(self) -> bool:
        return self.tp.size == 1 and super().can_fold_input_scale()


class MergedLinear(ColumnParallelLinear):
    """Several projections of the same input stacked along the output dim, e.g. gate_up_proj =
    [gate_proj; up_proj], each split across the tensor-parallel ranks (column-parallel): shard ``i``
    (an index or a name from ``shard_names``) fills local rows ``offsets[i] : offsets[i] +
    output_sizes[i]`` with its rank's slice of the checkpoint matrix. Sizes are local ones."""

    fuses_kernels = True

    def __init__(
        self, in_features: int, output_sizes: Sequence[int], bias: bool = False, shard_names: Sequence = ()
    ) -> None:
        tp = get_tp_group()
        for size in output_sizes:
            shard_range(size, tp.rank, tp.size, "each merged projection's output features")
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = [size // tp.size for size in output_sizes]
        self.checkpoint_sizes = list(output_sizes)  # rows of each projection in the checkpoint
        self.shard_starts = [self.tp.rank * size for size in self.output_sizes]  # this rank's first row
        self.shard_names = list(shard_names) or list(range(len(output_sizes)))
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(output_sizes))]
        for p in self.parameters():
            p.shard_ids = tuple(self.shard_names)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:  # a checkpoint that already stores the merged tensor: load each section
            if loaded_weight.shape[0] != sum(self.checkpoint_sizes):
                raise ValueError(f"weight shape {tuple(loaded_weight.shape)} does not match the merged "
                                 f"projections of {self.checkpoint_sizes} rows")
            start = 0
            for i, size in enumerate(self.checkpoint_sizes):
                self._load_shard(param, i, loaded_weight.narrow(0, start, size))
                start += size
            return
        self._load_shard(param, self.shard_names.index(shard_id), loaded_weight)

    def _load_shard(self, param: nn.Parameter, i: int, loaded_weight: torch.Tensor) -> None:
        if loaded_weight.shape[0] != self.checkpoint_sizes[i]:
            raise ValueError(f"weight shape {tuple(loaded_weight.shape)} does not match parameter shard "
                             f"of {self.checkpoint_sizes[i]} rows")
        default_weight_loader(param.narrow(0, self.offsets[i], self.output_sizes[i]),
                              self.checkpoint_slice(loaded_weight, self.shard_names[i]))

    def checkpoint_slice(self, loaded_weight: torch.Tensor, shard_id: object = None) -> torch.Tensor:
        """This rank's rows of shard ``shard_id`` (a name from ``shard_names``, or an index)."""
        i = self.shard_names.index(shard_id)
        return loaded_weight.narrow(0, self.shard_starts[i], self.output_sizes[i])


class QKVLinear(MergedLinear):
    """q, k and v projections in one GEMM: output ``[T, (H + 2*Hkv) * D]``, shards "q", "k", "v".

    ``forward_norm_rope_store`` is its fused method at one token row: residual add + RMSNorm + this
    projection + RoPE of q and k + the K/V store, in one launch."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = get_tp_group()
        shard_range(num_heads, tp.rank, tp.size, "num_attention_heads")
        if num_kv_heads >= tp.size:
            shard_range(num_kv_heads, tp.rank, tp.size, "num_key_value_heads")
        elif tp.size % num_kv_heads:
            raise ValueError(f"the tensor-parallel size ({tp.size}) must be a multiple of num_key_value_heads "
                             f"({num_kv_heads}) when it is larger")
        # Local heads: q heads split; kv heads split, or replicated where there are fewer than ranks.
        self.num_heads, self.num_kv_heads = num_heads // tp.size, max(1, num_kv_heads // tp.size)
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        kv_first_head = tp.rank * num_kv_heads // tp.size if num_kv_heads < tp.size else tp.rank * self.num_kv_heads
        # MergedLinear takes the sizes of all ranks together and keeps one rank's share of each.
        super().__init__(hidden_size, [self.q_size * tp.size, self.kv_size * tp.size, self.kv_size * tp.size],
                         bias, shard_names=("q", "k", "v"))
        self.checkpoint_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.shard_starts = [tp.rank * self.q_size, kv_first_head * head_dim, kv_first_head * head_dim]

    def forward_norm_rope_store(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, positions: torch.Tensor,
        cos_cache: torch.Tensor, sin_cache: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(q rotated [1, Hq * D], x + residual)`` with the row's rotated k and its v written to cache
        slot ``slot_mapping[0]``, in one launch (no q/k norm: the caller's check); None where that
        kernel does not apply (not one row on the fused GEMV path, a RoPE table not over the whole
        head, or a cache it does not take)."""
        quantized = self._quantized_fusion("apply_norm_qkv_rope_store")
        if quantized is not None:
            return quantized(self, x, residual, norm, positions, cos_cache, sin_cache, kv_cache,
                             slot_mapping) if norm.fuses_kernels else None
        if not (self._fused() and norm.fuses_kernels and triton_ops.norm_qkv_rope_fits(
                x, residual, norm.weight, self.weight, cos_cache, kv_cache, self.tuning)):
            return None
        return triton_ops.rms_norm_qkv_rope(x, residual, norm.weight, norm.eps, self.weight, self.bias, positions,
                                            cos_cache, sin_cache, self.num_heads, self.num_kv_heads, kv_cache,
                                            slot_mapping)
