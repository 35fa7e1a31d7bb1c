"""When the layers take their fused Triton kernels, and the thin calls into them.

Each layer keeps its torch code as the CPU path and as the test oracle; on CUDA tensors (and when
Triton is installed) it calls the one-launch kernel in ``pagedllm.layers.kernels`` instead:

- ``RMSNorm``: residual add + RMSNorm (or plain RMSNorm) -- one launch instead of ~9;
- ``RotaryEmbedding.forward``: Qwen3's per-head q/k RMSNorm + NeoX RoPE of q and k -- one launch
  instead of ~34;
- ``SiluAndMul``: one launch instead of 2 (plus the chunk views);
- ``Linear`` at 1-2 rows (decode at batch 1-2): the weight-streaming GEMV of
  ``kernels/skinny_gemm.py`` where it beats cuBLAS (``use_skinny_gemm`` says where);
- where that GEMV is taken, ``layers.fused`` folds the op before it into it (``kernels/fused_gemv.py``):
  residual add + RMSNorm + qkv / gate_up projection, and SiLU-and-mul + down projection -- one
  launch instead of two (``use_fused_norm_linear`` / ``use_fused_silu_and_mul_linear``); at one row,
  for models without a q/k norm, the RoPE of q and k and the KV store also run in the qkv GEMV's
  epilogue (``use_fused_norm_qkv_rope``) -- one launch instead of three.

The kernels reproduce the torch path's float semantics (fp32 math, and a rounding to the input dtype
wherever the torch path rounds) except that the norm GEMVs never round the normed row (they fold
the norm in one pass, ``kernels/fused_gemv.py``): in bf16 they differ from the separate launches by
about that one rounding.
This module imports without Triton (CI has none); the kernels are imported at their first call.

The switch: ``PAGEDLLM_FUSED_OPS=0`` in the environment turns the fused path off for the process;
``fused_ops(False)`` does so inside a ``with`` block (tests and before/after benchmarks).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

import torch

from pagedllm import envs

HAS_TRITON = importlib.util.find_spec("triton") is not None
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class _Switch:
    """The process-wide on/off switch (a configuration flag, not per-batch state)."""

    enabled = envs.PAGEDLLM_FUSED_OPS


@contextlib.contextmanager
def fused_ops(enabled: bool) -> Iterator[None]:
    """Turn the fused kernels on or off inside the block (restored on exit)."""
    old, _Switch.enabled = _Switch.enabled, enabled
    try:
        yield
    finally:
        _Switch.enabled = old


def fused_ops_enabled() -> bool:
    return _Switch.enabled and HAS_TRITON


def use_fused(x: torch.Tensor) -> bool:
    """Whether ``x`` (a CUDA tensor of a supported dtype) goes through a fused kernel."""
    return x.is_cuda and x.dtype in FUSED_DTYPES and fused_ops_enabled()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    from pagedllm.layers.kernels.rms_norm import rms_norm as kernel

    return kernel(x, weight, eps, residual)


def qk_norm_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    q_norm: tuple[torch.Tensor, float] | None = None,
    k_norm: tuple[torch.Tensor, float] | None = None,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    row_scale: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    from pagedllm.layers.kernels.rotary import qk_norm_rope as kernel

    return kernel(positions, q, k, cos_cache, sin_cache, q_norm, k_norm, kv_store=kv_store, row_scale=row_scale)


def silu_and_mul(x: torch.Tensor, row_scale: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    from pagedllm.layers.kernels.activation import silu_and_mul as kernel

    return kernel(x, row_scale=row_scale)


# The residual-stream forward (``models/llama.py``; its norms folded into the projections after them)
# from this many tokens up: below it the GEMVs take the norm and activation in their prologues and
# the narrow projections (o, down at two rows) are GEMVs, which have no residual-add epilogue.
RESIDUAL_STREAM_MIN_TOKENS = 3


def row_scale_fits(x: torch.Tensor, row_scale: tuple[torch.Tensor, float] | None) -> bool:
    """Whether a fused kernel takes ``row_scale = (s, eps)`` for the rows of ``x`` (2-D ``s`` with
    x's rows and dtype and a unit last stride); True without a row scale."""
    if row_scale is None:
        return True
    s = row_scale[0]
    return s.dim() == 2 and s.shape[0] == x.shape[0] and s.dtype == x.dtype and s.stride(-1) == 1


def use_residual_stream(x: torch.Tensor) -> bool:
    """Whether a forward over ``x`` (the embeddings ``[T, hidden]``) takes the residual-stream path."""
    return x.dim() == 2 and x.shape[0] >= RESIDUAL_STREAM_MIN_TOKENS and use_fused(x)


# Where the Triton GEMV (default launch parameters) beats cuBLAS, measured on an H200 with
# benchmarks/kernels/bench_skinny_gemm.py (weights read from HBM, in CUDA graphs): at one row for
# weights up to 32 Mi elements (e.g. Qwen3-0.6B's o_proj 12.4 -> 3.1 us and down_proj 7.5 -> 6.0 us,
# Llama-8B's qkv_proj 16.1 -> 15.0 us and o_proj 13.4 -> 11.7 us), and at two rows for narrow outputs
# (N <= 1024, K >= 2N: 0.6B's o_proj 11.3 -> 4.7 us), where cuBLAS has too few column tiles to fill
# the GPU. Larger weights, up to 128 Mi elements, take it at one row with their own launch parameters
# (skinny_gemm.LARGE_WEIGHT_ELEMENTS): Llama-8B's gate_up ties cuBLAS (54.4 vs 54.7 us) and down
# beats it (28.9 vs 31.5 us), and both then fuse the norm / activation before them (layers/fused.py).
# At 3-4 rows cuBLAS wins or ties.
SKINNY_MAX_WEIGHT_ELEMENTS = 128 * 2**20
SKINNY_NARROW_N = 1024


def use_skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.dim() != 2 or not 1 <= x.shape[0] <= 2 or x.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not use_fused(x) or x.stride(-1) != 1 or not weight.is_contiguous():
        return False
    n, k = weight.shape
    if x.shape[0] == 1:
        return n * k <= SKINNY_MAX_WEIGHT_ELEMENTS
    return n <= SKINNY_NARROW_N and k >= 2 * n


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from pagedllm.layers.kernels.skinny_gemm import skinny_linear as kernel

    return kernel(x, weight, bias)


# The LM head at one row (a step with one token to sample) takes the Triton GEMV too, in 32-column
# blocks of 512-element chunks with 4 warps: on an H200 (bench_skinny_gemm.py, weights from HBM)
# Qwen3-0.6B's 151,936 x 1,024 head 77.4 -> 71.9 us and Llama-8B's 128,256 x 4,096 237.7 -> 235.6 us
# against cuBLAS, which also zeroes a workspace before it (a 1.3 us memset and its gap). At 2+ rows
# cuBLAS wins (0.6B: 78 vs 111 us at two rows).
LM_HEAD_GEMV_CONFIG = (32, 512, 4)  # block_n, block_k, num_warps


def use_skinny_lm_head(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == x.dtype and use_fused(x) and x.stride(-1) == 1 and weight.is_contiguous())


def lm_head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from pagedllm.layers.kernels.skinny_gemm import skinny_linear as kernel

    block_n, block_k, num_warps = LM_HEAD_GEMV_CONFIG
    return kernel(x, weight, None, block_n=block_n, block_k=block_k, num_warps=num_warps)


def use_fused_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                          weight: torch.Tensor) -> bool:
    """Whether ``RMSNorm(x, residual)`` then ``Linear`` (``weight`` ``[N, K]``) take the one-launch
    ``rms_norm_linear``: exactly where the linear alone would take the Triton GEMV (the normed input
    has ``x``'s shape and dtype), with the norm weight, the residual and W all in ``x``'s dtype."""
    if not use_skinny_gemm(x, weight) or weight.dtype != x.dtype or norm_weight.dtype != x.dtype:
        return False
    if norm_weight.shape != (x.shape[1],) or not norm_weight.is_contiguous():
        return False
    return residual is None or (residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1)


def use_fused_silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``SiluAndMul(x)`` (``x`` ``[M, 2*I]``) then ``Linear`` (``weight`` ``[N, I]``) take the
    one-launch ``silu_and_mul_linear``: exactly where the linear alone would take the Triton GEMV
    (``use_skinny_gemm`` reads only M, dtype, strides and W's shape, so ``x`` stands for its input)."""
    return x.dim() == 2 and x.shape[1] == 2 * weight.shape[1] and weight.dtype == x.dtype and use_skinny_gemm(x, weight)


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    from pagedllm.layers.kernels.fused_gemv import rms_norm_linear as kernel

    return kernel(x, residual, norm_weight, eps, weight, bias)


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from pagedllm.layers.kernels.fused_gemv import silu_and_mul_linear as kernel

    return kernel(x, weight, bias)


def use_fused_norm_qkv_rope(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                            weight: torch.Tensor, cos_cache: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether ``RMSNorm`` -> qkv ``Linear`` -> RoPE -> KV store take the one-launch ``rms_norm_qkv_rope``:
    one token row where the norm + qkv GEMV is fused anyway (``use_fused_norm_linear``), a float32 RoPE
    table over the whole head (the caller checks that there is no q/k norm), and a KV cache of x's
    dtype with the head dim last and contiguous."""
    if x.shape[0] != 1 or not use_fused_norm_linear(x, residual, norm_weight, weight):
        return False
    return (cos_cache.dtype == torch.float32 and cos_cache.stride(-1) == 1 and kv_cache.dim() == 5
            and kv_cache.dtype == x.dtype and kv_cache.stride(-1) == 1
            and kv_cache.shape[-1] == 2 * cos_cache.shape[-1])


def rms_norm_qkv_rope(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                      cos_cache: torch.Tensor, sin_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from pagedllm.layers.kernels.fused_gemv import rms_norm_qkv_rope as kernel

    return kernel(x, residual, norm_weight, eps, weight, bias, positions, cos_cache, sin_cache, num_q_heads,
                  num_kv_heads, kv_cache, slot_mapping)
