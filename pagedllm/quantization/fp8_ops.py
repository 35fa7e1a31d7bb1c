"""FP8 (float8_e4m3fn) quantization and the FP8 GEMM, on the GPU and on the CPU.

Numbers: a weight row ``n`` is ``W[n, :] ~= Wq[n, :] * w_scale[n]`` (per output channel, float32
scales) and an activation row ``m`` is ``x[m, :] ~= xq[m, :] * x_scale[m]`` (per token, computed per
call; or one scale for the whole tensor). Then ``y[m, n] = (xq[m] . Wq[n]) * x_scale[m] * w_scale[n]``
with the dot product accumulated in float32: exactly what ``torch._scaled_mm`` computes on Hopper
(cuBLASLt, row-wise scales) and what ``fp8_linear_tiled`` computes on any device, a tile of weight
rows at a time (the float32 copy of one tile is the only extra memory).

Decode rows (``gemv_fits``: CUDA, at most ``kernels/fp8_gemv.GEMV_MAX_ROWS`` rows): the Triton
weight-only GEMV (``fp8_gemv``) reads each weight byte once and multiplies the activations as they
are (no activation quantization: one launch, or two with split K, and a product closer to the
float one), with the residual add + RMSNorm or the SiLU-and-mul before it in its prologue where the
layer's fused methods ask (``rms_norm_fp8_gemv``, ``silu_and_mul_fp8_gemv``); above, the activations
are quantized and cuBLASLt multiplies.

Batch rows (``batch_gemm``: CUDA, ``GEMV_MAX_ROWS`` + 1 to ``BATCH_MAX_ROWS`` rows, a batched decode
step): per-token activation codes, then the GEMM that ``BATCH_GEMM`` names: "fp8_mm" (the Triton
FP8 MMA with the operands swapped, ``kernels/fp8_mm.py``: 0.76x cuBLASLt's time summed over the 8B
projections at 64 rows on an H100) or "scaled_mm" (cuBLASLt). The op before the projection
(residual add + RMSNorm, SiLU-and-mul) writes the codes in its own launch where the layer's fused
methods ask (``rms_norm_quant``, ``silu_and_mul_quant``): one launch fewer per projection.

Constraints of ``torch._scaled_mm`` (checked by ``scaled_mm_fits``): CUDA with compute capability
>= 8.9, K and N multiples of 16, row-wise scales (torch >= 2.5), which take a bfloat16 output only.
Elsewhere (the CPU, float16 or float32 models, odd shapes) the tiled path runs.

Block-wise checkpoints (``fp8_linear_blockwise``): one weight scale per ``bn x bk`` block and one
activation scale per token and group of ``bk`` columns; both operands are dequantized a tile of
whole blocks at a time (every device; no cuBLASLt path yet).
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# A scale never goes below this (an all-zero row would give 0 and then 0/0): vLLM's lower bound.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
HAS_TRITON = importlib.util.find_spec("triton") is not None
# Weight elements per float32 tile of the tiled GEMM (8 MiB).
TILE_ELEMENTS = 1 << 21
# The GEMM of batch rows (module doc) and the most rows it takes (above: act-quant + cuBLASLt).
BATCH_GEMMS = ("fp8_mm", "scaled_mm")
BATCH_GEMM = "fp8_mm"
BATCH_MAX_ROWS = 128


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Wq [N, K] float8_e4m3fn, scale [N] float32)`` with ``W ~= Wq * scale[:, None]``: each row
    scaled so that its largest magnitude maps to 448 (round to nearest)."""
    w = w.float()
    scale = (w.abs().amax(dim=-1) / FP8_MAX).clamp_min(MIN_SCALE)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_activations(x: torch.Tensor, static_scale: torch.Tensor | None,
                         per_token: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq [M, K] float8, scale [M, 1] float32)`` for ``x [M, K]``: the checkpoint's static scale
    where given, else dynamic: per token (row) or one for the whole tensor. On CUDA per token: one
    launch (``kernels/fp8_act_quant.py``); else a handful of small ones (the max-norm reads ``x`` in
    its own dtype)."""
    if per_token and static_scale is None and HAS_TRITON and x.is_cuda:
        from pagedllm.quantization.kernels import fp8_act_quant

        if fp8_act_quant.fits(x):
            return fp8_act_quant.per_token_quant(x, FP8_MAX, MIN_SCALE)
    rows = x.shape[0]
    if static_scale is not None:
        scale = static_scale.float().reshape(1, 1).expand(rows, 1)
    else:
        if per_token:
            amax = torch.linalg.vector_norm(x, ord=math.inf, dim=-1, keepdim=True, dtype=torch.float32)
        else:
            amax = torch.linalg.vector_norm(x, ord=math.inf, dtype=torch.float32).reshape(1, 1).expand(rows, 1)
        scale = (amax / FP8_MAX).clamp_min(MIN_SCALE)
    # The clamp matters for static scales (and e4m3fn has no infinity to saturate to).
    return torch.div(x, scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.contiguous()


def quantize_activation_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq [M, K] float8, scale [M, ceil(K / group)] float32)``: one dynamic scale per token and
    group of ``group`` consecutive columns (the activations of block-wise FP8 checkpoints)."""
    xf = x.float()
    m, k = xf.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(xf, (0, groups * group - k)).view(m, groups, group)
    scale = (padded.abs().amax(dim=-1) / FP8_MAX).clamp_min(MIN_SCALE)
    xq = (xf / expand_blocks(scale, 1, group, m, k)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return xq, scale


def expand_blocks(scale: torch.Tensor, block_rows: int, block_cols: int, rows: int, cols: int) -> torch.Tensor:
    """A ``[rows, cols]`` matrix of per-block ``scale`` values (``scale[i // block_rows, j // block_cols]``)."""
    return scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]


def fp8_linear_blockwise(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                         block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """``[M, N]`` for block-wise FP8 (``W ~= Wq * w_scale[n // bn, k // bk]``) with per-token-group
    activations (groups of ``bk`` columns): both dequantized, a tile of whole weight blocks at a time."""
    bn, bk = block
    xq, x_scale = quantize_activation_groups(x, bk)
    m, k = xq.shape
    xf = xq.float() * expand_blocks(x_scale, 1, bk, m, k)
    n = wq.shape[0]
    rows = max(1, TILE_ELEMENTS // max(k, 1) // bn) * bn
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        tile_scale = expand_blocks(w_scale[start // bn: -(-stop // bn)], bn, bk, stop - start, k)
        out[:, start:stop] = xf @ (wq[start:stop].float() * tile_scale).t()
    return out.to(out_dtype)


def dequantize_rows(wq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``Wq * scale[:, None]`` in ``dtype`` (the float matrix a quantized layer stands for)."""
    return (wq.float() * scale.float()[:, None]).to(dtype)


@functools.cache
def _has_fp8_tensor_cores(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def scaled_mm_fits(x: torch.Tensor, wq: torch.Tensor) -> bool:
    """Whether ``torch._scaled_mm`` takes this product (module doc)."""
    if not (x.is_cuda and hasattr(torch, "_scaled_mm") and x.dtype == torch.bfloat16):
        return False
    n, k = wq.shape
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return k % 16 == 0 and n % 16 == 0 and _has_fp8_tensor_cores(index)


def gemv_fits(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> bool:
    """Whether the Triton weight-only GEMV takes this product (module doc)."""
    if not (HAS_TRITON and x.is_cuda and x.dim() == 2):
        return False
    from pagedllm.quantization.kernels import fp8_gemv

    return x.shape[0] <= fp8_gemv.GEMV_MAX_ROWS and fp8_gemv.fits(x, wq, w_scale)


def batch_gemm(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> str | None:
    """The GEMM that multiplies the codes of ``x`` at batch rows (``BATCH_GEMM``, module doc), or None:
    not batch rows (or not CUDA), or a product that GEMM does not take."""
    if not (HAS_TRITON and x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)):
        return None
    from pagedllm.quantization.kernels import fp8_gemv

    if not fp8_gemv.GEMV_MAX_ROWS < x.shape[0] <= BATCH_MAX_ROWS:
        return None
    if BATCH_GEMM == "scaled_mm":
        return BATCH_GEMM if scaled_mm_fits(x, wq) else None
    fits = (wq.dim() == 2 and wq.is_contiguous() and wq.dtype == FP8_DTYPE and x.shape[1] == wq.shape[1]
            and w_scale.numel() == wq.shape[0] and w_scale.is_contiguous())
    return BATCH_GEMM if fits else None


def batch_product(kind: str, xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``[M, N]`` by the batch GEMM ``kind`` (``batch_gemm``'s answer) on the activation codes ``xq``
    with their ``x_scale [M, 1]``."""
    if kind == "scaled_mm":
        y = fp8_linear_scaled_mm(xq, x_scale, wq, w_scale, out_dtype)
        return y if bias is None else y + bias
    from pagedllm.quantization.kernels import fp8_mm

    return fp8_mm.fp8_mm(xq, x_scale, wq, w_scale, bias, out_dtype)


def rms_norm_quant(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(codes, scales [M, 1], x + residual)`` of ``rmsnorm(x + residual) * g`` per token in one launch
    (``kernels/fp8_act_quant.rms_norm_quant``), or None where that kernel does not take it."""
    if not (HAS_TRITON and x.is_cuda):
        return None
    from pagedllm.quantization.kernels import fp8_act_quant

    if not (fp8_act_quant.fused_fits(x, x.shape[-1]) and norm_weight.dtype == x.dtype and norm_weight.is_contiguous()
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.stride(-1) == 1))):
        return None
    return fp8_act_quant.rms_norm_quant(x, residual, norm_weight, eps, FP8_MAX, MIN_SCALE)


def silu_and_mul_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(codes, scales [M, 1])`` of ``silu(gate) * up`` per token in one launch, or None where that
    kernel does not take ``x``."""
    if not (HAS_TRITON and x.is_cuda and x.dim() == 2 and x.shape[-1] % 2 == 0):
        return None
    from pagedllm.quantization.kernels import fp8_act_quant

    if not fp8_act_quant.fused_fits(x, x.shape[-1] // 2):
        return None
    return fp8_act_quant.silu_and_mul_quant(x, FP8_MAX, MIN_SCALE)


def fp8_gemv(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``[M, N]`` in x's dtype: ``x @ (Wq * w_scale)^T (+ bias)`` by the Triton GEMV (precondition: ``gemv_fits``)."""
    from pagedllm.quantization.kernels import fp8_gemv as kernel

    return kernel.fp8_gemv(x, wq, w_scale, bias)


def prologue_fits(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, prologue: str) -> bool:
    """Whether the GEMV takes ``prologue`` ("norm": residual add + RMSNorm of ``x``; "act": SiLU-and-mul
    of ``x = [gate | up]``) at ``x``'s rows (``kernels/fp8_gemv.prologue_fits``), on CUDA."""
    if not (HAS_TRITON and x.is_cuda and x.dim() == 2):
        return False
    from pagedllm.quantization.kernels import fp8_gemv as kernel

    code = kernel.NORM_PROLOGUE if prologue == "norm" else kernel.ACT_PROLOGUE
    return kernel.prologue_fits(x, wq, w_scale, code)


def rms_norm_fp8_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      wq: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(GEMV of rmsnorm(x + residual) * g, x + residual)`` in one launch (precondition: ``prologue_fits``)."""
    from pagedllm.quantization.kernels import fp8_gemv as kernel

    return kernel.rms_norm_fp8_gemv(x, residual, norm_weight, eps, wq, w_scale, bias)


def silu_and_mul_fp8_gemv(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """GEMV of ``silu(gate) * up`` for ``x = [gate | up]`` in one launch (precondition: ``prologue_fits``)."""
    from pagedllm.quantization.kernels import fp8_gemv as kernel

    return kernel.silu_and_mul_fp8_gemv(x, wq, w_scale, bias)


def norm_qkv_rope_store(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                        cos_cache: torch.Tensor, sin_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                        kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q rotated, x + residual)`` with k and v stored: residual add + RMSNorm + the qkv GEMV + RoPE +
    the K/V store for one token row in one launch (``kernels/fp8_qkv_rope.py``), or None where that
    kernel does not take the call (not CUDA, shapes or dtypes it does not take)."""
    if not (HAS_TRITON and x.is_cuda):
        return None
    from pagedllm.quantization.kernels import fp8_qkv_rope

    if not fp8_qkv_rope.fits(x, residual, norm_weight, wq, w_scale, cos_cache, kv_cache, num_q_heads, num_kv_heads):
        return None
    return fp8_qkv_rope.fp8_qkv_rope(x, residual, norm_weight, eps, wq, w_scale, bias, positions, cos_cache,
                                     sin_cache, num_q_heads, num_kv_heads, kv_cache, slot_mapping)


def fp8_linear_scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """``[M, N]`` through cuBLASLt: ``xq [M, K]`` row-major, ``wq [N, K]`` (passed transposed: the
    column-major ``[K, N]`` operand it wants), scales ``[M, 1]`` and ``[1, N]``."""
    return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale.reshape(1, -1), out_dtype=out_dtype)


def fp8_linear_tiled(x: torch.Tensor, x_scale: torch.Tensor | None, wq: torch.Tensor,
                     w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``[M, N]``: ``x`` (float8 with ``x_scale [M, 1]``, or a float ``x`` with ``x_scale`` None:
    weight-only) times the dequantized weight, one float32 tile of weight rows at a time."""
    xf = x.float()
    n, k = wq.shape
    rows = max(1, TILE_ELEMENTS // max(k, 1))
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        out[:, start:stop] = (xf @ wq[start:stop].float().t()) * w_scale[start:stop].float()
    if x_scale is not None:
        out *= x_scale
    return out.to(out_dtype)
