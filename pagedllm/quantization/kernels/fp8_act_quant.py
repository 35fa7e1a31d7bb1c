"""Per-token dynamic FP8 quantization of activations in one launch (the input of cuBLASLt's FP8
GEMM above the GEMV rows): ``xq[m, :] = clamp(x[m, :] / scale[m], -448, 448)`` as float8_e4m3fn
with ``scale[m] = max(max_k |x[m, k]| / 448, MIN_SCALE)``, the numbers of
``fp8_ops.quantize_activations`` (whose torch form takes four launches and a float32 copy).

One program a row: a first pass over the row for its largest magnitude, a second (from L2) that
writes the codes. Grid ``(M,)``; no host sync (capturable). Requirements (``fits``): a 2-D
contiguous float input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


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
