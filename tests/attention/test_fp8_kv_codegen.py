"""The float8 decode kernel's machine code, compiled ahead of time for Hopper (sm_90) without a GPU.

Triton compiles for a named target offline (its wheel carries ``ptxas``), so these run wherever
Triton is installed. They pin the code shape that makes a float8 cache fast: the V tile must not be
transposed byte by byte out of shared memory (``paged_attention._upcast_v_tile``), which made the
kernel issue 1.7x the instructions of its bf16 version.
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow

QWEN3_06B = dict(NUM_HEADS=16, QUERIES_PER_KV=2, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16, BLOCK_M=16)


def _decode_ptx(cache: str) -> str:
    """PTX of ``_decode_split_kernel`` for a ``cache`` ("bf16", "fp8e4nv", "fp8e5") cache under a bf16
    query, at the nano-bench's shape and the kernel's default launch configuration."""
    triton = pytest.importorskip("triton")
    tl = pytest.importorskip("triton.language")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedllm.attention.triton_kernels import paged_attention

    fn = paged_attention._decode_split_kernel
    compute = tl.bfloat16 if cache == "bf16" else tl.float16
    constexprs = dict(QWEN3_06B, TILE_N=64, SPLIT=False, MIN_SPLIT_LEN=64, DOT_PRECISION="tf32",
                      COMPUTE_DTYPE=compute, HAS_ORDER=True, USE_PDL=False, SLIDING_WINDOW=0, SOFT_CAP=0.0)
    pointers = {"k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}", "q_ptr": "*bf16", "out_ptr": "*bf16",
                "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32"}
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*i32")
        else:
            signature[name] = "fp32" if name == "scale_log2" else "i32"
    src = ASTSource(fn, signature, constexprs=constexprs)
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 2, "num_stages": 3})
    except Exception as exc:  # noqa: BLE001 - a Triton without its CUDA backend or ptxas
        pytest.skip(f"cannot compile for sm_90 here: {exc!s:.200}")
    return kernel.asm["ptx"]


def _count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx))


@pytest.mark.parametrize("cache,cvt", [("fp8e4nv", "e4m3x2"), ("fp8e5", "e5m2x2")])
def test_fp8_v_tile_is_not_transposed_bytewise(cache, cvt):
    fp8, bf16 = _decode_ptx(cache), _decode_ptx("bf16")
    assert _count(fp8, r"ld\.shared\.[bus]8") == 0, "the V tile is read from shared memory one byte at a time"
    assert _count(fp8, r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans") > 0  # staged as float16, transposed by ldmatrix
    assert _count(fp8, rf"cvt\.rn\.f16x2\.{cvt}") > 0
    # Half the bytes: half the 16-byte async copies of the bf16 kernel's K/V tiles.
    assert _count(fp8, r"cp\.async\.cg\.shared\.global") * 2 == _count(bf16, r"cp\.async\.cg\.shared\.global")
