"""Triton kernels of the quantized linear layers (these modules import triton: imported only on
CUDA, or under Triton's interpreter in tests).

- ``int4_gemm``: int4 GPTQ / AWQ weights (``quantization/int4.py``'s serving form) dequantized in
  the GEMV / tiled GEMM;
- ``gguf_gemm``: GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) kept packed, decoded in the GEMV /
  tiled GEMM (and a dequantize kernel);
- ``fp8_gemv``: float8 weights with bfloat16 activations at up to 32 rows (the GEMV, optionally with
  the norm or SiLU-and-mul in its prologue); ``fp8_mm``: the tensor-core GEMM at batch rows (33-128);
  ``fp8_act_quant``: per-token activation quantization (alone, or fused with the norm / SiLU-and-mul);
- ``splitk``: the sum of the split-K GEMVs' partials (fp8 and int4).
"""
