"""The second half of the split-K GEMVs (``fp8_gemv``, ``int4_gemm``): ``out[m, n] = sum_s ws[s, m,
n] (+ bias[n])`` over the float32 partial sums ``ws [split, M, N]``, rounded once to out's dtype.
One pass over the partials; ``USE_PDL`` lets it wait for the GEMV under programmatic dependent
launch (``pagedllm/pdl.py``) and release the next kernel early."""

from __future__ import annotations

import triton
import triton.language as tl

from pagedllm.triton_pdl import allow_dependents, wait_for_inputs


@triton.jit
def splitk_sum_kernel(ws_ptr, b_ptr, out_ptr, M, N, stride_om, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_inputs(USE_PDL)
    allow_dependents(USE_PDL)  # one short wave: the next kernel may take the SMs it leaves
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (offs // N) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)
