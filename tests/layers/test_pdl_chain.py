"""Programmatic dependent launch (pagedllm/pdl.py) keeps a chain of decode kernels ordered: a
CUDA graph of one layer's batch-1 kernels (fused norm + GEMV, GEMV, fused SiLU + GEMV, RMSNorm,
repeated), captured with PDL, gives bit for bit the results of the same chain without PDL, on
fresh inputs every replay and with every intermediate buffer poisoned (NaN) before it, so a kernel
that read its input before the kernel ahead had written it would show. GPU (Hopper) only."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _chain(x, res, layers, norm_w):
    from pagedllm.layers.kernels.fused_gemv import rms_norm_linear, silu_and_mul_linear
    from pagedllm.layers.kernels.rms_norm import rms_norm
    from pagedllm.layers.kernels.skinny_gemm import skinny_linear

    for w_in, w_mid, w_up, w_down in layers:
        h, res = rms_norm_linear(x, res, norm_w, 1e-6, w_in)  # [1, H] -> [1, H]
        h = skinny_linear(h, w_mid)
        gate_up = skinny_linear(h, w_up)  # [1, 2I]
        x = silu_and_mul_linear(gate_up, w_down)  # [1, H]
        x, res = rms_norm(x, norm_w, 1e-6, residual=res)
    return x, res


def test_pdl_chain_in_a_cuda_graph_matches_the_plain_chain():
    from pagedllm import pdl

    if not pdl._supports_pdl(torch.cuda.current_device()):
        pytest.skip("PDL needs compute capability >= 9 and Triton's gdc_wait")
    hidden, inter, num_layers = 1024, 2048, 4
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * scale

    layers = [
        (rand(hidden, hidden, scale=hidden**-0.5), rand(hidden, hidden, scale=hidden**-0.5),
         rand(2 * inter, hidden, scale=hidden**-0.5), rand(hidden, inter, scale=inter**-0.5))
        for _ in range(num_layers)
    ]  # fmt: skip
    norm_w = rand(hidden) + 1.0
    x_in = torch.zeros(1, hidden, device="cuda", dtype=torch.bfloat16)
    res_in = torch.zeros_like(x_in)
    graphs, outputs = {}, {}
    for on in (False, True):
        with pdl.pdl(on):
            _chain(x_in, res_in, layers, norm_w)  # compile outside the capture
            torch.cuda.synchronize()
            graphs[on] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[on]):
                outputs[on] = _chain(x_in, res_in, layers, norm_w)
    for _ in range(6):  # fresh inputs: a read of a stale buffer would see the previous replay's values
        x_in.copy_(rand(1, hidden))
        res_in.copy_(rand(1, hidden))
        graphs[False].replay()
        expected = [t.clone() for t in outputs[False]]
        graphs[True].replay()
        torch.cuda.synchronize()
        for got, want in zip(outputs[True], expected):
            assert torch.equal(got, want)
        with pdl.pdl(True):  # and eagerly, launch after launch
            eager = _chain(x_in, res_in, layers, norm_w)
        for got, want in zip(eager, expected):
            assert torch.equal(got, want)
