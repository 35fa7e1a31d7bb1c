"""The Triton small-M GEMV (layers/kernels/skinny_gemm.py) against F.linear in float32. GPU only."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (100, 77), (6144, 4096)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_skinny_linear_matches_f_linear(m, n, k, bias, dtype):
    from pagedllm.layers.kernels.skinny_gemm import skinny_linear

    gen = torch.Generator(device="cuda").manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) * 0.05
    b = torch.randn(n, device="cuda", dtype=dtype, generator=gen) if bias else None
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    out = skinny_linear(x, w, b)
    assert out.shape == (m, n) and out.dtype == dtype
    rel = float((out.float() - ref).norm() / ref.norm())
    assert rel < (1e-2 if dtype == torch.bfloat16 else 1e-5), rel


def test_strided_rows_are_read_by_stride():
    """x may be a row slice of a wider buffer (the stride is not K)."""
    from pagedllm.layers.kernels.skinny_gemm import skinny_linear

    big = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    x = big[:, :1024]
    w = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16) * 0.05
    ref = F.linear(x.float(), w.float())
    out = skinny_linear(x, w)
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("rows", [1, 2])
def test_lm_head_takes_the_gemv_at_one_row(rows, monkeypatch):
    """One row: the Triton GEMV with the LM-head launch config (``DeviceTuning.lm_head_gemv_config``);
    more rows: cuBLAS. Both give F.linear's logits within bf16 noise."""
    from pagedllm.config import KernelConfig
    from pagedllm.layers import prepare_model_kernels, triton_ops
    from pagedllm.layers.embedding import LMHead

    head = LMHead(32_000 + 5, 512).to(device="cuda", dtype=torch.bfloat16)
    prepare_model_kernels(head, torch.device("cuda"), KernelConfig())
    head.weight.data.normal_(0, 512**-0.5)
    hidden = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = triton_ops.lm_head_linear
    monkeypatch.setattr(triton_ops, "lm_head_linear", lambda x, w, t: calls.append(x.shape[0]) or real(x, w, t))
    logits = head(hidden, upcast=False)
    assert calls == ([1] if rows == 1 else [])
    ref = F.linear(hidden.float(), head.weight.float())
    assert logits.dtype == torch.bfloat16 and logits.shape == (rows, 32_005)
    assert ((logits.float() - ref).norm() / ref.norm()).item() < 1e-2
