"""SiLU-and-mul: ``x = [gate | up]`` ``[T, 2*I]`` -> ``silu(gate) * up`` ``[T, I]`` in one launch.

As the torch path: ``silu`` in float32 rounded to the input dtype, then the product rounded again.
Grid ``(T, cdiv(I, BLOCK))``; reads ``2*I`` and writes ``I`` elements per row, once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.pdl import launch_kwargs
from pagedllm.triton_pdl import allow_dependents, wait_for_inputs


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_inputs(USE_PDL)
    allow_dependents(USE_PDL)  # no main loop: the next kernel may be placed at once (pagedllm/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    io_dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(io_dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``SiluAndMul.forward`` for ``x`` ``[..., 2*I]`` with an even last dim; ``out`` (optional,
    contiguous ``[..., I]``) is written in place."""
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
        _silu_and_mul_kernel[grid](x2, out2, x2.stride(0), out2.stride(0), size, BLOCK=block, num_warps=4,
                                   **launch_kwargs(x.device))
    return out
