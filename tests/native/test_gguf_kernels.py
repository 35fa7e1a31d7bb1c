"""The GGUF block kernels of the C library against the ``gguf`` package: exact dequantization per
format (random blocks), the embedding gather, and the packed product against the float one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.native import kernels as native

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

needs_kernels = pytest.mark.skipif(native.load() is None, reason="no C compiler to build the CPU kernels")

# Byte offsets of each block's f16 scales (kept finite: random bytes could make them inf / nan).
FORMATS = {"F16": None, "Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(name: str, rows: int, k: int, seed: int) -> np.ndarray:
    """``[rows, row_bytes]`` random bytes of format ``name`` with finite f16 scales."""
    qtype = GGMLQuantizationType[name]
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, size=(rows, k // elems, nbytes), dtype=np.uint8)
    halves = range(0, nbytes, 2) if FORMATS[name] is None else FORMATS[name]
    for h in halves:
        raw[..., h + 1] &= 0xBB  # exponent < 0x1f: finite; some subnormals and zeros stay
    return raw.reshape(rows, -1)


@needs_kernels
@pytest.mark.parametrize("name", FORMATS)
def test_dequantize_rows_equals_gguf_bit_for_bit(name):
    qtype = GGMLQuantizationType[name]
    raw = random_blocks(name, 37, 512, seed=len(name))
    ref = dequantize(raw, qtype).reshape(37, 512)
    got = native.gguf_dequantize_rows(torch.from_numpy(raw), int(qtype), 512).numpy()
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


@needs_kernels
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
def test_dequantize_gather_takes_the_listed_rows(name):
    qtype = GGMLQuantizationType[name]
    raw = random_blocks(name, 50, 256, seed=3)
    ids = torch.tensor([7, 0, 49, 7])
    got = native.gguf_dequantize_gather(torch.from_numpy(raw), int(qtype), 256, ids)
    ref = torch.from_numpy(dequantize(raw, qtype).reshape(50, 256))[ids]
    assert torch.equal(got, ref)
    with pytest.raises(IndexError):
        native.gguf_dequantize_gather(torch.from_numpy(raw), int(qtype), 256, torch.tensor([50]))


@needs_kernels
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 4, 9])  # the 4-row register blocks and their tails
def test_matmul_equals_the_float_product(name, m):
    qtype = GGMLQuantizationType[name]
    n, k = 45, 512  # 45 rows: a partial chunk of 16
    raw = random_blocks(name, n, k, seed=m)
    w = torch.from_numpy(dequantize(raw, qtype).reshape(n, k).copy())
    x = torch.randn(m, k + 8, generator=torch.Generator().manual_seed(m))[:, :k]  # strided rows
    out = torch.full((m, n + 3), float("nan"))
    native.gguf_matmul(x, torch.from_numpy(raw), int(qtype), out[:, 1:1 + n])  # a column slice
    ref = x @ w.t()
    torch.testing.assert_close(out[:, 1:1 + n], ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert out[:, 0].isnan().all() and out[:, 1 + n:].isnan().all(), "columns outside the slice are untouched"


@needs_kernels
def test_bad_shapes_and_types_are_refused():
    raw = torch.from_numpy(random_blocks("Q4_1", 4, 64, seed=0))
    with pytest.raises(ValueError, match="do not hold"):
        native.gguf_dequantize_rows(raw, int(GGMLQuantizationType.Q4_1), 96)
    with pytest.raises(ValueError, match="no CPU kernel"):
        native.gguf_dequantize_rows(raw, int(GGMLQuantizationType.IQ2_XXS), 64)
    with pytest.raises(ValueError, match="cannot hold"):
        native.gguf_matmul(torch.randn(2, 64), raw, int(GGMLQuantizationType.Q4_1), torch.empty(2, 3))


def q8_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w^T`` with each 32-value block of ``x`` rounded as the int8 kernel does (scale
    max|x| / 127, values round(x * 127 / max|x|), ties to even), in float64."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv)
    xq = (q.double() * (amax / 127.0).double()).reshape(m, k)
    return (xq @ w.double().t()).float()


@needs_kernels
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 5, 8, 19])  # the 8-row tiles and their tails
@pytest.mark.parametrize("k", [96, 576])  # 3 and 18 blocks: groups of 4 blocks with padded tails
def test_int8_activation_matmul_equals_the_quantized_product(name, m, k):
    qtype = int(GGMLQuantizationType[name])
    if not native.gguf_q8_supported(qtype):
        pytest.skip("no AVX2 on this CPU: no int8 kernel")
    n = 37
    raw = random_blocks(name, n, k, seed=m + k)
    w = torch.from_numpy(dequantize(raw, GGMLQuantizationType[name]).reshape(n, k).copy())
    x = torch.randn(m, k + 8, generator=torch.Generator().manual_seed(m))[:, :k]
    x[0, :32] = 0.0  # an all-zero block: scale 0
    out = torch.full((m, n + 2), float("nan"))
    native.gguf_matmul(x, torch.from_numpy(raw), qtype, out[:, 1:1 + n], int8_activations=True)
    ref = q8_reference(x, w)
    torch.testing.assert_close(out[:, 1:1 + n], ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert out[:, 0].isnan().all() and out[:, 1 + n:].isnan().all(), "columns outside the slice are untouched"
    exact = x @ w.t()
    rel = float((out[:, 1:1 + n] - exact).abs().max() / exact.abs().max())
    assert 0 < rel < 2e-2, rel  # the activations' rounding, and nothing more


@needs_kernels
def test_int8_activations_are_refused_for_a_format_without_that_kernel():
    raw = torch.from_numpy(random_blocks("Q6_K", 4, 256, seed=0))
    with pytest.raises(ValueError, match="int8_activations"):
        native.gguf_matmul(torch.randn(2, 256), raw, int(GGMLQuantizationType.Q6_K), torch.empty(2, 4),
                           int8_activations=True)


@needs_kernels
def test_int8_kernel_without_vnni_uses_avx2_and_agrees():
    """The same library compiled without VNNI (a CPU with AVX2 only): vpmaddubsw, and the sign
    trick for Q8_0's signed weights. Skipped where this CPU has no AVX2 to run it."""
    import ctypes
    import shutil

    if not native.gguf_q8_supported(3):
        pytest.skip("no AVX2 on this CPU")
    from pagedllm import envs

    lib = ctypes.CDLL(str(native._build(shutil.which(envs.CC) or envs.CC, ("-mno-avx512vnni", "-mno-avxvnni"))))
    assert lib.gguf_q8_isa() == 1
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gguf_matmul_q8.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, ctypes.c_int]
    m, n, k = 5, 21, 160
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    for name in ("Q4_0", "Q4_1", "Q8_0"):
        qtype = GGMLQuantizationType[name]
        raw = torch.from_numpy(random_blocks(name, n, k, seed=2))
        out = torch.empty(m, n)
        assert lib.gguf_matmul_q8(int(qtype), raw.data_ptr(), raw.shape[1], n, k, x.data_ptr(), k, m,
                                  out.data_ptr(), n, 1) == 0
        ref = native.gguf_matmul(x, raw, int(qtype), torch.empty(m, n), int8_activations=True)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
