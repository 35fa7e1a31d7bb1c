"""SiLU-and-mul: ``x = [gate | up]`` ``[T, 2*I]`` -> ``silu(gate) * up`` ``[T, I]`` in one launch.

As the torch path: ``silu`` in float32 rounded to the input dtype, then the product rounded again.
With ``row_scale = (s, eps)`` (the residual-stream forward, ``models/llama.py``: ``x`` is the gate/up
projection of the un-normed stream ``s``, whose weight holds the RMSNorm weight) gate and up of row
``t`` are first multiplied by ``1 / sqrt(mean(s[t]^2) + eps)`` and rounded to the input dtype.
Grid ``(T, cdiv(I, BLOCK))``; reads ``2*I`` and writes ``I`` elements per row, once (plus the row of
``s`` per program with a row scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.layers.kernels.rotary import _row_rstd, _scaled
from pagedllm.pdl import launch_kwargs
from pagedllm.triton_pdl import allow_dependents, wait_for_inputs


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, s_ptr, stride_x, stride_out, stride_s, n_cols, s_eps, BLOCK: tl.constexpr,
                         HAS_ROW_SCALE: tl.constexpr, S_COLS: tl.constexpr, S_PAD: tl.constexpr,
                         USE_PDL: tl.constexpr):
    wait_for_inputs(USE_PDL)
    allow_dependents(USE_PDL)  # no main loop: the next kernel may be placed at once (pagedllm/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    io_dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_ROW_SCALE:
        row_scale = _row_rstd(s_ptr + row * stride_s, s_eps, S_COLS, S_PAD)
        gate = _scaled(gate, row_scale, io_dtype, True)
        up = _scaled(up, row_scale, io_dtype, True)
    act = (gate / (1.0 + tl.exp(-gate))).to(io_dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None,
                 row_scale: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """``SiluAndMul.forward`` for ``x`` ``[..., 2*I]`` with an even last dim; ``out`` (optional,
    contiguous ``[..., I]``) is written in place. ``row_scale = (s [rows, C], eps)`` (rows as x's
    flattened rows, x's dtype, unit last stride) scales gate and up by each row's RMS of ``s`` first
    (``norm.rms_scale`` is the torch equivalent)."""
    size = x.shape[-1] // 2
    assert x.shape[-1] == 2 * size
    x2 = x.reshape(-1, 2 * size)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((*x.shape[:-1], size), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, size)
    if x2.shape[0] > 0 and size > 0:
        block = min(triton.next_power_of_2(size), 1024)
        grid = (x2.shape[0], triton.cdiv(size, block))
        stream, s_eps = row_scale if row_scale is not None else (x2, 0.0)
        if row_scale is not None:
            assert stream.dim() == 2 and stream.shape[0] == x2.shape[0] and stream.stride(-1) == 1
        cols = stream.shape[1] if row_scale is not None else 1
        _silu_and_mul_kernel[grid](x2, out2, stream, x2.stride(0), out2.stride(0), stream.stride(0), size, s_eps,
                                   BLOCK=block, HAS_ROW_SCALE=row_scale is not None, S_COLS=cols,
                                   S_PAD=triton.next_power_of_2(cols), num_warps=4, **launch_kwargs(x.device))
    return out
