"""FP8 quantization and the FP8 GEMM (pagedllm/quantization/fp8_ops.py) against torch references
that dequantize: the tiled CPU product in CI, cuBLASLt's ``_scaled_mm`` on a Hopper GPU."""

from __future__ import annotations

import pytest
import torch

from pagedllm.quantization import fp8_ops


def _rand(*shape: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def test_quantize_rows_maps_each_rows_largest_magnitude_to_448():
    w = _rand(48, 96) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different scales
    w[5] = 0.0  # an all-zero row must not divide by zero
    wq, scale = fp8_ops.quantize_rows(w)
    assert wq.dtype == torch.float8_e4m3fn and wq.element_size() == 1 and scale.dtype == torch.float32
    assert scale.shape == (48,)
    amax = wq.float().abs().amax(dim=1)
    assert torch.equal(amax[torch.arange(48) != 5], torch.full((47,), 448.0))
    assert torch.equal(wq[5].float(), torch.zeros(96))
    # e4m3 has 3 mantissa bits: each element within half a step (2^-4 relative) of its value,
    # or within the subnormal step of its row's scale.
    err = (fp8_ops.dequantize_rows(wq, scale) - w).abs()
    assert (err <= w.abs() * 2**-4 + scale[:, None] * 2**-9 + 1e-12).all()


@pytest.mark.parametrize("mode", ["token", "tensor", "static"])
def test_quantize_activations(mode):
    x = _rand(5, 32, seed=1) * torch.tensor([1e-3, 1.0, 10.0, 0.1, 3.0])[:, None]
    static = torch.tensor([0.01]) if mode == "static" else None
    xq, scale = fp8_ops.quantize_activations(x, static, per_token=mode == "token")
    assert xq.dtype == torch.float8_e4m3fn and scale.shape == (5, 1)
    if mode == "token":
        assert torch.allclose(scale[:, 0], x.abs().amax(dim=1) / 448.0)
    elif mode == "tensor":
        assert torch.allclose(scale, torch.full((5, 1), float(x.abs().max()) / 448.0))
    else:
        assert torch.equal(scale, torch.full((5, 1), 0.01))
        assert xq.float().abs().max() == 448.0  # the 10x row saturates at the static scale
    if mode != "static":
        assert torch.allclose(xq.float() * scale, x, rtol=2**-4, atol=float(scale.max()) * 2**-9)


def _reference(xq, x_scale, wq, w_scale):
    """The dequantized product, in float64."""
    x = xq.double() * (x_scale.double() if x_scale is not None else 1.0)
    return x @ (wq.double() * w_scale.double()[:, None]).t()


@pytest.mark.parametrize("rows", [1, 2, 7])
def test_tiled_product_equals_the_dequantized_reference(monkeypatch, rows):
    monkeypatch.setattr(fp8_ops, "TILE_ELEMENTS", 64 * 10)  # tiles of 10 rows: 40 = 4 tiles
    wq, w_scale = fp8_ops.quantize_rows(_rand(40, 64, seed=2))
    x = _rand(rows, 64, seed=3)
    xq, x_scale = fp8_ops.quantize_activations(x, None)
    y = fp8_ops.fp8_linear_tiled(xq, x_scale, wq, w_scale, torch.float32)
    torch.testing.assert_close(y.double(), _reference(xq, x_scale, wq, w_scale), rtol=1e-5, atol=1e-5)
    weight_only = fp8_ops.fp8_linear_tiled(x, None, wq, w_scale, torch.float32)
    torch.testing.assert_close(weight_only.double(), x.double() @ fp8_ops.dequantize_rows(wq, w_scale).double().t(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
def test_block_wise_product_equals_the_dequantized_reference(monkeypatch, rows):
    """Blocks that do not divide the matrix (40 x 72 in 16 x 32 blocks), several tiles."""
    monkeypatch.setattr(fp8_ops, "TILE_ELEMENTS", 72 * 16)
    w, x = _rand(40, 72, seed=6), _rand(rows, 72, seed=7)
    w_scale = torch.rand(3, 3, generator=torch.Generator().manual_seed(8)) / 100 + 1e-3
    wq = (w / fp8_ops.expand_blocks(w_scale, 16, 32, 40, 72)).clamp(-448, 448).to(fp8_ops.FP8_DTYPE)
    y = fp8_ops.fp8_linear_blockwise(x, wq, w_scale, (16, 32), torch.float32)
    xq, x_scale = fp8_ops.quantize_activation_groups(x, 32)
    assert x_scale.shape == (rows, 3)
    assert torch.allclose(x_scale[:, 2], x[:, 64:].abs().amax(dim=1) / 448.0)
    ref_x = xq.double() * x_scale.double().repeat_interleave(32, 1)[:, :72]
    ref_w = wq.double() * w_scale.double().repeat_interleave(16, 0)[:40].repeat_interleave(32, 1)[:, :72]
    torch.testing.assert_close(y.double(), ref_x @ ref_w.t(), rtol=1e-5, atol=1e-5)


def test_scaled_mm_is_not_taken_on_the_cpu_or_for_odd_shapes():
    wq, _ = fp8_ops.quantize_rows(_rand(32, 32))
    assert not fp8_ops.scaled_mm_fits(_rand(2, 32).bfloat16(), wq)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 5, 64, 300])
@pytest.mark.parametrize("out_features,in_features", [(256, 128), (4096, 1024), (48, 80)])
def test_scaled_mm_equals_the_dequantized_reference_on_cuda(rows, out_features, in_features):
    """cuBLASLt with row-wise scales on Hopper (the tiled product elsewhere, and for shapes it does
    not take): the dequantized float64 product within bfloat16 rounding."""
    wq, w_scale = fp8_ops.quantize_rows(_rand(out_features, in_features, seed=4, device="cuda"))
    x = _rand(rows, in_features, seed=5, device="cuda").bfloat16()
    xq, x_scale = fp8_ops.quantize_activations(x, None)
    if fp8_ops.scaled_mm_fits(x, wq):
        y = fp8_ops.fp8_linear_scaled_mm(xq, x_scale, wq, w_scale, torch.bfloat16)
    else:
        assert in_features % 16 or out_features % 16 or torch.cuda.get_device_capability() < (8, 9)
        y = fp8_ops.fp8_linear_tiled(xq, x_scale, wq, w_scale, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
    ref = _reference(xq, x_scale, wq, w_scale)
    torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
    if torch.cuda.get_device_capability() >= (9, 0) and in_features % 16 == 0 and out_features % 16 == 0:
        assert fp8_ops.scaled_mm_fits(x, wq), "Hopper must take cuBLASLt for these shapes"
