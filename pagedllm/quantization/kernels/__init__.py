"""Triton kernels of the quantized linear layers (these modules import triton: imported only on
CUDA, or under Triton's interpreter in tests).

- ``int4_gemm``: int4 GPTQ / AWQ weights (``quantization/int4.py``'s serving form) dequantized in
  the GEMV / tiled GEMM;
- ``gguf_gemm``: GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) kept packed, decoded in the GEMV /
  tiled GEMM (and a dequantize kernel).
"""
