"""Triton kernels of the layers (imported only on the fused path: these modules import triton).

- ``rms_norm``: residual add + RMSNorm, one program per token row;
- ``rotary``: optional per-head q/k RMSNorm + NeoX RoPE of q and k, one launch for both;
- ``activation``: SiLU(gate) * up;
- ``skinny_gemm``: the weight-streaming GEMV for 1-4 rows (decode at small batch);
- ``fused_gemv``: that GEMV with residual add + RMSNorm, or SiLU-and-mul, in its prologue.

Every launcher takes host shapes only (no host syncs, no data-dependent grids), so all of them can
be captured in a CUDA graph. Each accepts preallocated outputs (``out=``) for tests and graphs.
"""
