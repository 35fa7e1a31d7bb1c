"""Fused residual add + RMSNorm: ``(x, residual) -> (weight * rmsnorm(x + residual), x + residual)``.

Float semantics follow ``RMSNorm``'s torch path (HF's): the add is rounded to the input dtype, the
norm is computed in float32 from that rounded sum, ``x * rstd`` is rounded to the input dtype and
then multiplied by the weight (rounded to the output dtype, ``promote(weight, x)``).

Cost: one program per row; each reads x (and residual) and writes out (and the new residual) once:
``(2 or 4) * hidden`` elements per row. Rows longer than ``MAX_BLOCK`` take two passes over the row
(x and residual read twice, from L2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.pdl import launch_kwargs
from pagedllm.triton_pdl import allow_dependents, wait_for_inputs

MAX_BLOCK = 8192


@triton.jit
def _load_sum(x_ptr, res_ptr, res_out_ptr, cols, mask, store_mask, HAS_RESIDUAL: tl.constexpr,
              STORE_SUM: tl.constexpr):
    """Load one chunk of a row as float32; with a residual, ``(x + res)`` rounded to the input dtype
    (stored to ``res_out`` under ``store_mask`` when ``STORE_SUM``). Also used by ``fused_gemv.py``."""
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(x_ptr.dtype.element_ty)
        if STORE_SUM:
            tl.store(res_out_ptr + cols, s, mask=store_mask)
        x = s.to(tl.float32)
    return x


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    allow_dependents(USE_PDL)  # no main loop: the next kernel may be placed at once (pagedllm/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    x_ptr += row * stride_x
    out_ptr += row * stride_out
    if HAS_RESIDUAL:
        res_ptr += row * stride_res
        res_out_ptr += row * stride_res_out
    io_dtype = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    if NUM_CHUNKS == 1:  # the whole row stays in registers
        mask = cols < n_cols
        x = _load_sum(x_ptr, res_ptr, res_out_ptr, cols, mask, mask, HAS_RESIDUAL, True)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (x * rstd).to(io_dtype).to(tl.float32) * w
        tl.store(out_ptr + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # pass 1: sum of squares (and the new residual); pass 2: recompute the sum, scale, store
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            offs = c * BLOCK + cols
            x = _load_sum(x_ptr, res_ptr, res_out_ptr, offs, offs < n_cols, offs < n_cols, HAS_RESIDUAL, True)
            acc += x * x
        rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
        for c in range(NUM_CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < n_cols
            x = _load_sum(x_ptr, res_ptr, res_out_ptr, offs, mask, mask, HAS_RESIDUAL, False)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            y = (x * rstd).to(io_dtype).to(tl.float32) * w
            tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, hidden]`` with a unit last stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    max_block: int = MAX_BLOCK,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward`` in one launch: ``normed`` or, with ``residual``, ``(normed, x + residual)``.

    ``x`` and ``residual`` (same shape and dtype) may have strided rows; ``out`` / ``residual_out``
    (optional, contiguous, shaped like ``x``) are written in place. ``max_block`` caps the elements
    one program holds at a time (tests lower it to exercise the two-pass loop).
    """
    hidden = x.shape[-1]
    x2 = _rows(x)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        res2 = _rows(residual)
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        res_out2 = residual_out.view(-1, hidden)
    else:
        res2 = res_out2 = x2  # unused by the kernel
    rows = x2.shape[0]
    if rows > 0:
        block = min(triton.next_power_of_2(hidden), max_block)
        _rms_norm_kernel[(rows,)](
            x2, res2, weight, out2, res_out2,
            x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            NUM_CHUNKS=triton.cdiv(hidden, block),
            num_warps=min(max(block // 256, 1), 16),
            **launch_kwargs(x.device),
        )  # fmt: skip
    return out if residual is None else (out, residual_out)
