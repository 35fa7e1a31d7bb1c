"""Per-token dynamic FP8 quantization of activations in one launch (the input of the FP8 x FP8
GEMMs above the GEMV rows): ``xq[m, :] = clamp(x[m, :] / scale[m], -448, 448)`` as float8_e4m3fn
with ``scale[m] = max(max_k |x[m, k]| / 448, MIN_SCALE)``, the numbers of
``fp8_ops.quantize_activations`` (whose torch form takes four launches and a float32 copy).

- ``per_token_quant``: one program a row: a first pass over the row for its largest magnitude, a
  second (from L2) that writes the codes. Requirements (``fits``): a 2-D contiguous float input.
- ``rms_norm_quant``: the op before a projection and its quantization in one launch: residual add
  + RMSNorm (``RMSNorm.forward`` rounded as the Triton norm rounds it) then the codes of the normed
  row, and the new residual; ``silu_and_mul_quant``: ``silu(gate) * up`` (rounded as
  ``SiluAndMul``) then its codes. Each program holds its whole row in registers (``fused_fits``:
  rows up to ``MAX_FUSED_COLS``). Bit for bit the unfused ops followed by ``per_token_quant``.

Grid ``(M,)``; no host sync (capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.layers.kernels.fused_gemv import _silu_mul_chunk
from pagedllm.layers.kernels.rms_norm import _load_sum

BLOCK = 1024
# The fused kernels hold a row in registers: at most this many columns (16 warps, 32 values a thread).
MAX_FUSED_COLS = 16384


@triton.jit
def _per_token_quant_kernel(x_ptr, xq_ptr, scale_ptr, K, fp8_max, min_scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * K
    amax = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), fp8_max), min_scale)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)  # IEEE division, as torch's
        tl.store(xq_ptr + row * K + cols, q.to(xq_ptr.dtype.element_ty), mask=cols < K)


def fits(x: torch.Tensor) -> bool:
    """Whether the kernel takes ``x`` (module doc)."""
    return x.dim() == 2 and x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float16, torch.float32)


def per_token_quant(x: torch.Tensor, fp8_max: float, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq [M, K] float8_e4m3fn, scale [M, 1] float32)`` (module doc). Precondition: ``fits``."""
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _per_token_quant_kernel[(m,)](x, xq, scale, k, fp8_max, min_scale, BLOCK=min(BLOCK, triton.next_power_of_2(k)),
                                      num_warps=4)
    return xq, scale


@triton.jit
def _quantize_row(y, cols, mask, xq_row, scale_ptr, fp8_max, min_scale):
    """Store the codes of the float32 row ``y`` (already rounded to the activations' dtype) and its scale."""
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), axis=0), fp8_max), min_scale)
    tl.store(scale_ptr, scale)
    q = tl.minimum(tl.maximum(tl.math.div_rn(y, scale), -fp8_max), fp8_max)
    tl.store(xq_row + cols, q.to(xq_row.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_quant_kernel(x_ptr, res_ptr, res_out_ptr, g_ptr, xq_ptr, scale_ptr, K, eps, fp8_max, min_scale,
                           stride_x, stride_res, stride_res_out, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    s = _load_sum(x_ptr + row * stride_x, res_ptr + row * stride_res, res_out_ptr + row * stride_res_out, cols,
                  mask, mask, HAS_RESIDUAL, True)
    rstd = tl.math.rsqrt(tl.sum(s * s, axis=0) / K + eps)
    io_dtype = x_ptr.dtype.element_ty
    g = tl.load(g_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = ((s * rstd).to(io_dtype).to(tl.float32) * g).to(io_dtype).to(tl.float32)
    _quantize_row(y, cols, mask, xq_ptr + row * K, scale_ptr + row, fp8_max, min_scale)


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, xq_ptr, scale_ptr, K, stride_x, fp8_max, min_scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    y = _silu_mul_chunk(x_ptr + row * stride_x, cols, mask, K)
    _quantize_row(y, cols, mask, xq_ptr + row * K, scale_ptr + row, fp8_max, min_scale)


def fused_fits(x: torch.Tensor, cols: int) -> bool:
    """Whether the fused kernels take ``x`` (rows of ``cols`` results: the hidden size for the norm,
    half of x's row for SiLU-and-mul): 2-D, bf16 / fp16 with unit last stride, ``cols`` at most
    ``MAX_FUSED_COLS``."""
    return (x.dim() == 2 and x.stride(-1) == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and 0 < cols <= MAX_FUSED_COLS)


def _outputs(m: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(m, k, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(m, 1, dtype=torch.float32, device=device))


def _warps(block: int) -> int:
    """The Triton RMSNorm's warps for a row of ``block`` (the same reduction tree: the same rstd)."""
    return min(max(block // 256, 1), 16)


def rms_norm_quant(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                   fp8_max: float, min_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(xq, scale, x + residual)``: the per-token codes of ``rmsnorm(x + residual) * g`` (without a
    residual: of ``rmsnorm(x) * g``, and ``x`` itself third). Precondition: ``fused_fits(x, K)``,
    ``residual`` like ``x`` with unit last stride, ``norm_weight [K]`` contiguous in x's dtype."""
    m, k = x.shape
    xq, scale = _outputs(m, k, x.device)
    residual_out = torch.empty_like(x) if residual is not None else x
    res = residual if residual is not None else x
    if m:
        block = triton.next_power_of_2(k)
        _rms_norm_quant_kernel[(m,)](x, res, residual_out, norm_weight, xq, scale, k, eps, fp8_max, min_scale,
                                     x.stride(0), res.stride(0), residual_out.stride(0),
                                     HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block))
    return xq, scale, residual_out


def silu_and_mul_quant(x: torch.Tensor, fp8_max: float, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq, scale)``: the per-token codes of ``silu(gate) * up`` for ``x = [gate | up]`` ``[M, 2K]``.
    Precondition: ``fused_fits(x, K)``."""
    m, k2 = x.shape
    k = k2 // 2
    xq, scale = _outputs(m, k, x.device)
    if m:
        block = triton.next_power_of_2(k)
        _silu_and_mul_quant_kernel[(m,)](x, xq, scale, k, x.stride(0), fp8_max, min_scale, BLOCK=block,
                                         num_warps=_warps(block))
    return xq, scale
