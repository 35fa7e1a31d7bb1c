"""pagedllm.layers: the building blocks of our models (not transformers' classes)."""

from pagedllm.layers import triton_ops
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import LMHead, VocabEmbedding
from pagedllm.layers.fused import fused_norm_linear, fused_norm_qkv_rope, fused_silu_and_mul_linear
from pagedllm.layers.linear import Linear, MergedLinear, QKVLinear, default_weight_loader
from pagedllm.layers.norm import RMSNorm, rms_scale
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq, get_rope_parameters

__all__ = [
    "Attention",
    "LMHead",
    "Linear",
    "MergedLinear",
    "QKVLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "VocabEmbedding",
    "apply_rotary",
    "compute_inv_freq",
    "default_weight_loader",
    "fused_norm_linear",
    "fused_norm_qkv_rope",
    "fused_silu_and_mul_linear",
    "get_rope_parameters",
    "rms_scale",
    "triton_ops",
]
