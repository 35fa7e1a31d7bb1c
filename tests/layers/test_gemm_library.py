"""layers/gemm_library.py: the per-shape cuBLAS / cuBLASLt choice of one engine (a ``GemmLibrary``,
owned by its KernelPlan). The table logic runs on the CPU; timing and the cuBLASLt calls need CUDA."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.config import KernelConfig
from pagedllm.layers import prepare_model_kernels
from pagedllm.layers.gemm_library import GemmLibrary
from pagedllm.layers.linear import Linear

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def gemm_library():
    return GemmLibrary(margin=0.03)


def test_cpu_calls_are_f_linear_whatever_the_table_says(gemm_library):
    x, w, b = torch.randn(8, 16), torch.randn(12, 16), torch.randn(12)
    gemm_library.set_choices([(12, 16, 8)])
    assert gemm_library.choices() == {(12, 16, 8)}
    assert torch.equal(gemm_library.linear(x, w, b), F.linear(x, w, b))
    layer = Linear(16, 12, bias=True)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    assert torch.equal(layer(x), F.linear(x, w, b))


def test_tune_ignores_cpu_weights(gemm_library):
    summary = gemm_library.tune([torch.randn(12, 16)], [8, 16])
    assert summary["measured"] == 0 and gemm_library.choices() == frozenset()


def test_each_plan_owns_its_table():
    """Two engines' plans: the CUDA linear layers share their own plan's table, nothing global."""
    a, b = Linear(16, 12), Linear(16, 12)
    plan_a = prepare_model_kernels(a, torch.device("cuda"), KernelConfig(fold_norms=False))
    plan_b = prepare_model_kernels(b, torch.device("cuda"), KernelConfig(fold_norms=False))
    assert a.gemms is plan_a.gemms and b.gemms is plan_b.gemms and plan_a.gemms is not plan_b.gemms
    plan_a.gemms.set_choices([(12, 16, 8)])
    assert plan_b.gemms.choices() == frozenset()


@pytest.mark.gpu
@needs_cuda
def test_tune_times_every_shape_and_size_and_skips_what_skip_says(gemm_library):
    ws = [torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    ws += [torch.randn(768, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    summary = gemm_library.tune(ws, [8, 64, 8], skip=lambda x, w: w.shape[0] == 768 and x.shape[0] == 64)
    assert summary["measured"] == 3  # (1024, 512) at 8 and 64, (768, 1024) at 8
    assert summary["cublaslt"] == len(gemm_library.choices())
    assert gemm_library.choices() <= {(1024, 512, 8), (1024, 512, 64), (768, 1024, 8)}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("bias", [False, True])
def test_cublaslt_choice_matches_f_linear_eager_and_in_a_graph(bias, gemm_library):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    b = torch.randn(2048, device="cuda", dtype=torch.bfloat16, generator=gen) if bias else None
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    gemm_library.set_choices([(2048, 4096, 64)])
    default = torch.backends.cuda.preferred_blas_library()
    eager = gemm_library.linear(x, w, b)
    assert torch.backends.cuda.preferred_blas_library() == default  # restored after the call
    assert float((eager.float() - ref).norm() / ref.norm()) < 1e-2
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemm_library.linear(x, w, b)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm_library.linear(x, w, b)
    x.copy_(torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=gen))
    graph.replay()
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2
