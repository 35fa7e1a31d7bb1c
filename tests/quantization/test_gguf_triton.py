"""The GGUF block kernels for the GPU (``quantization/kernels/gguf_gemm.py``): their decoding equals
the ``gguf`` package's ``dequantize`` bit for bit, and the GEMV / GEMM equal the product with that
matrix; under Triton's interpreter in CI (a subprocess with ``TRITON_INTERPRET=1``), and on CUDA
(``gpu``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

HAS_DEPS = all(importlib.util.find_spec(m) is not None for m in ("triton", "gguf"))
QTYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
# Where each block type keeps its float16 factors (d, and dmin / m): random bytes there could be NaN.
HALF_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """``[n, bytes of k weights]`` uint8: random codes, scales and mins, finite float16 factors."""
    from pagedllm.quantization.kernels.gguf_gemm import GGUF_BLOCKS

    _, qk, nbytes = GGUF_BLOCKS[qtype]
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // qk, nbytes), generator=gen, dtype=torch.uint8)
    for offset in HALF_OFFSETS[qtype]:
        factors = (torch.rand(n, k // qk, generator=gen) * 0.02 - 0.005).half()
        blocks[:, :, offset:offset + 2] = factors.view(torch.uint8).reshape(n, k // qk, 2)
    return blocks.reshape(n, -1)


def gguf_reference(w: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType, dequantize

    return torch.from_numpy(np.ascontiguousarray(dequantize(w.cpu().numpy(), GGMLQuantizationType[qtype]))).float()


def check(qtype: str, m: int, n: int, k: int, dtype: torch.dtype, device: str) -> tuple[float, float]:
    """``(largest decoding difference, relative max error of the product)`` for one shape."""
    from pagedllm.quantization.kernels import gguf_gemm

    w = random_blocks(qtype, n, k).to(device)
    want_w = gguf_reference(w, qtype, k)
    decoding = float((gguf_gemm.gguf_dequantize(w, qtype, k).cpu() - want_w).abs().max())
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    bias = torch.randn(n).to(device, dtype)
    want = x.float().cpu() @ want_w.t() + bias.float().cpu()
    got = gguf_gemm.gguf_linear(x, w, qtype, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    return decoding, float((got.float().cpu() - want).abs().max() / want.abs().max())


def _interpreter_main() -> None:
    from pagedllm.quantization.kernels import gguf_gemm

    for qtype in QTYPES:
        k = 512 if qtype.endswith("_K") else 96
        for m, n in ((1, 24), (3, 16), (6, 40), (9, 40)):  # GEMV (1, 3, 6 rows) and GEMM; ragged N
            decoding, err = check(qtype, m, n, k, torch.float32, "cpu")
            assert decoding == 0 and err < 1e-5, (qtype, m, n, decoding, err)
            print("ok", qtype, m, n, err)
        w = random_blocks(qtype, 40, k)
        ids = torch.tensor([39, 0, 7, 7, 21])
        assert torch.equal(gguf_gemm.gguf_gather(w, qtype, k, ids), gguf_reference(w, qtype, k)[ids])
        print("gathered", qtype)


@pytest.mark.skipif(not HAS_DEPS, reason="needs Triton and gguf")
def test_gguf_kernels_match_the_gguf_package_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    code = f"import runpy; runpy.run_path({__file__!r})['_interpreter_main']()"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("ok") == 4 * len(QTYPES)
    assert proc.stdout.count("gathered") == len(QTYPES)


@pytest.mark.skipif(not HAS_DEPS, reason="needs Triton and gguf")
def test_bad_shapes_are_refused_naming_the_layout():
    from pagedllm.quantization.kernels import gguf_gemm

    with pytest.raises(ValueError, match=r"^qtype must be one of"):
        gguf_gemm.gguf_linear(torch.zeros(1, 32), torch.zeros(4, 18, dtype=torch.uint8), "Q3_K")
    with pytest.raises(ValueError, match=r"^a Q4_0 weight of 48 columns"):
        gguf_gemm.gguf_linear(torch.zeros(1, 48), torch.zeros(4, 18, dtype=torch.uint8), "Q4_0")


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_DEPS and torch.cuda.is_available()), reason="needs Triton, gguf and CUDA")
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 2, 4, 6, 64, 300])
def test_gguf_kernels_on_cuda(qtype, m):
    decoding, err = check(qtype, m, 4096, 4096, torch.bfloat16, "cuda")
    assert err < 1e-2, err
    assert decoding < 1e-6  # float32 factors of about 1e-2: a fused multiply-add may round once less
