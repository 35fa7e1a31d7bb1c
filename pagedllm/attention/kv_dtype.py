"""The KV cache's storage dtype (``kv_cache_dtype``, vLLM's names) and the FP8 conversions of K/V.

``"auto"`` stores K/V in the model's compute dtype. ``"fp8_e4m3"`` (alias ``"fp8"``) and
``"fp8_e5m2"`` store one byte an element (float8_e4m3fn: 3 mantissa bits, range +-448;
float8_e5m2: 2 mantissa bits, range +-57344), so the same memory holds twice the blocks of a
bf16 cache and decode attention reads half the bytes.

Scales: every layer's ``k_scale`` and ``v_scale`` are 1.0, vLLM's default for a checkpoint that
carries none: K/V are cast as they are, values beyond the format's range saturate to its largest
finite value (as the GPU's ``cvt.satfinite`` does), and readers upcast to the query's dtype. A
scale only moves the window of representable magnitudes (e4m3: normal from 2^-6 to 448), not the
relative precision inside it; trained models' keys and values sit inside that window
(tests/attention/test_fp8_kv_accuracy.py bounds SmolLM2's perplexity change), while very small
values (tiny random test models) fall into the subnormals and keep fewer bits. Checkpoint scales
(``k_scale``/``v_scale`` tensors) are not read: the loader refuses a checkpoint that has them as
having unexpected weights.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype,
                         device: torch.device | None = None) -> torch.dtype:
    """The storage dtype of the KV cache for ``CacheConfig.cache_dtype`` ("auto": ``model_dtype``).
    A float8 cache on a CUDA device needs compute capability 8.9+ (Ada, Hopper): the Triton
    kernels convert to and from float8 with the instructions those GPUs have."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype not in FP8_KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8', 'fp8_e4m3' or 'fp8_e5m2', got {cache_dtype!r}")
    if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"kv_cache_dtype={cache_dtype!r} needs a GPU of compute capability 8.9 or newer "
                         f"(this one is {torch.cuda.get_device_capability(device)}): use 'auto'")
    return FP8_KV_DTYPES[cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: a plain cast, saturating at the format's largest finite value for
    float8 (torch's cast would give NaN for e4m3 and inf for e5m2 past it)."""
    if is_fp8(cache_dtype):
        limit = torch.finfo(cache_dtype).max
        return x.float().clamp(-limit, limit).to(cache_dtype)
    return x.to(cache_dtype)


def from_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K/V read from the cache in the dtype attention computes in: a float8 cache is upcast to
    ``dtype`` (exact: every float8 value is a bf16/fp16/fp32 value); any other cache is returned as is."""
    return x.to(dtype) if is_fp8(x.dtype) else x
