"""The thin calls into the layers' Triton kernels, and the shape predicates that say where one applies.

The modules' CUDA implementations (chosen once at load by ``layers/dispatch.py``) call these:

- ``RMSNorm``: residual add + RMSNorm (or plain RMSNorm) -- one launch instead of ~9;
- ``RotaryEmbedding``: Qwen3's per-head q/k RMSNorm + NeoX RoPE of q and k (and the KV store) --
  one launch instead of ~34;
- ``SiluAndMul``: one launch instead of 2 (plus the chunk views);
- ``Linear`` at 1-2 rows (decode at batch 1-2): the weight-streaming GEMV of
  ``kernels/skinny_gemm.py`` where it beats cuBLAS (``skinny_gemm_fits``, from the device's tuning row);
- where that GEMV is taken, the op before it runs in its prologue (``kernels/fused_gemv.py``):
  residual add + RMSNorm + qkv / gate_up projection, and SiLU-and-mul + down projection -- one launch
  instead of two (``norm_prologue_fits`` / ``act_prologue_fits``); at one row, for models without a
  q/k norm, the RoPE of q and k and the KV store also run in the qkv GEMV's epilogue
  (``norm_qkv_rope_fits``) -- one launch instead of three.

The kernels reproduce the torch path's float semantics (fp32 math, and a rounding to the input dtype
wherever the torch path rounds) except that the norm GEMVs never round the normed row (they fold
the norm in one pass, ``kernels/fused_gemv.py``): in bf16 they differ from the separate launches by
about that one rounding.
This module imports without Triton (CI has none); the kernels are imported at their first call.
Nothing here is a switch: whether the fused kernels run at all is the engine's ``KernelConfig``,
applied once when ``prepare_model_kernels`` chooses each module's implementation.
"""

from __future__ import annotations

import importlib.util

import torch

from pagedllm.layers.tuning import DeviceTuning

HAS_TRITON = importlib.util.find_spec("triton") is not None
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fusable(x: torch.Tensor) -> bool:
    """Whether ``x`` (a CUDA tensor of a supported dtype) can go through a fused kernel."""
    return x.is_cuda and x.dtype in FUSED_DTYPES


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


def row_scale_fits(x: torch.Tensor, row_scale: tuple[torch.Tensor, float] | None) -> bool:
    """Whether a fused kernel takes ``row_scale = (s, eps)`` for the rows of ``x`` (2-D ``s`` with
    x's rows and dtype and a unit last stride); True without a row scale."""
    if row_scale is None:
        return True
    s = row_scale[0]
    return s.dim() == 2 and s.shape[0] == x.shape[0] and s.dtype == x.dtype and s.stride(-1) == 1


def skinny_gemm_fits(x: torch.Tensor, weight: torch.Tensor, tuning: DeviceTuning) -> bool:
    """Whether ``F.linear(x, weight)`` takes the Triton GEMV: 1-2 half-precision rows, at one row up to
    ``tuning.skinny_max_weight_elements``, at two rows narrow outputs (``tuning.skinny_narrow_n``)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= 2 or x.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not fusable(x) or x.stride(-1) != 1 or not weight.is_contiguous():
        return False
    n, k = weight.shape
    if x.shape[0] == 1:
        return n * k <= tuning.skinny_max_weight_elements
    return n <= tuning.skinny_narrow_n and k >= 2 * n


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from pagedllm.layers.kernels.skinny_gemm import skinny_linear as kernel

    return kernel(x, weight, bias)


def skinny_lm_head_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the LM head takes the Triton GEMV (``lm_head_linear``): one half-precision row."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == x.dtype and fusable(x) and x.stride(-1) == 1 and weight.is_contiguous())


def lm_head_linear(x: torch.Tensor, weight: torch.Tensor, tuning: DeviceTuning) -> torch.Tensor:
    from pagedllm.layers.kernels.skinny_gemm import skinny_linear as kernel

    block_n, block_k, num_warps = tuning.lm_head_gemv_config
    return kernel(x, weight, None, block_n=block_n, block_k=block_k, num_warps=num_warps)


def norm_prologue_fits(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                       weight: torch.Tensor, tuning: DeviceTuning) -> bool:
    """Whether ``RMSNorm(x, residual)`` then ``Linear`` (``weight`` ``[N, K]``) take the one-launch
    ``rms_norm_linear``: exactly where the linear alone would take the Triton GEMV (the normed input
    has ``x``'s shape and dtype), with the norm weight, the residual and W all in ``x``'s dtype."""
    if not skinny_gemm_fits(x, weight, tuning) or weight.dtype != x.dtype or norm_weight.dtype != x.dtype:
        return False
    if norm_weight.shape != (x.shape[1],) or not norm_weight.is_contiguous():
        return False
    return residual is None or (residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1)


def act_prologue_fits(x: torch.Tensor, weight: torch.Tensor, tuning: DeviceTuning) -> bool:
    """Whether ``SiluAndMul(x)`` (``x`` ``[M, 2*I]``) then ``Linear`` (``weight`` ``[N, I]``) take the
    one-launch ``silu_and_mul_linear``: exactly where the linear alone would take the Triton GEMV
    (``skinny_gemm_fits`` reads only M, dtype, strides and W's shape, so ``x`` stands for its input)."""
    return (x.dim() == 2 and x.shape[1] == 2 * weight.shape[1] and weight.dtype == x.dtype
            and skinny_gemm_fits(x, weight, tuning))


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    from pagedllm.layers.kernels.fused_gemv import rms_norm_linear as kernel

    return kernel(x, residual, norm_weight, eps, weight, bias)


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from pagedllm.layers.kernels.fused_gemv import silu_and_mul_linear as kernel

    return kernel(x, weight, bias)


def norm_qkv_rope_fits(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                       weight: torch.Tensor, cos_cache: torch.Tensor, kv_cache: torch.Tensor,
                       tuning: DeviceTuning) -> bool:
    """Whether ``RMSNorm`` -> qkv ``Linear`` -> RoPE -> KV store take the one-launch ``rms_norm_qkv_rope``:
    one token row where the norm + qkv GEMV is fused anyway (``norm_prologue_fits``), a float32 RoPE
    table over the whole head (the caller checks that there is no q/k norm), and a KV cache of x's
    dtype with the head dim last and contiguous."""
    if x.shape[0] != 1 or not norm_prologue_fits(x, residual, norm_weight, weight, tuning):
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
