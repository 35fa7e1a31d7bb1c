"""pagedllm.layers: the building blocks of our models (not transformers' classes).

Ops (``CustomOp``: one implementation per device, chosen once by ``prepare_model_kernels``), the
compound modules that fuse an op with the linear layer next to it, and the residual state that
says which form a forward runs in.
"""

from pagedllm.layers.activation import GeluTanhAndMul, SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.compound import (
    AttentionInputs,
    LinearAdd,
    NormLinear,
    NormQKVRope,
    RopeKVWrite,
    SiluAndMulLinear,
    fold_norms,
)
from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.dispatch import prepare_model_kernels
from pagedllm.layers.embedding import LMHead, VocabEmbedding
from pagedllm.layers.kernel_plan import KernelPlan
from pagedllm.layers.linear import (
    ColumnParallelLinear,
    Linear,
    MergedLinear,
    QKVLinear,
    RowParallelLinear,
    default_weight_loader,
)
from pagedllm.layers.norm import RMSNorm, rms_scale
from pagedllm.layers.residual import ResidualForm, ResidualState
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq, get_rope_parameters

__all__ = [
    "Attention",
    "AttentionInputs",
    "CustomOp",
    "GeluTanhAndMul",
    "KernelPlan",
    "LMHead",
    "ColumnParallelLinear",
    "Linear",
    "RowParallelLinear",
    "LinearAdd",
    "MergedLinear",
    "NormLinear",
    "NormQKVRope",
    "QKVLinear",
    "RMSNorm",
    "ResidualForm",
    "ResidualState",
    "RopeKVWrite",
    "RotaryEmbedding",
    "SiluAndMul",
    "SiluAndMulLinear",
    "VocabEmbedding",
    "apply_rotary",
    "compute_inv_freq",
    "default_weight_loader",
    "fold_norms",
    "get_rope_parameters",
    "prepare_model_kernels",
    "rms_scale",
]
