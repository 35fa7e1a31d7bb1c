"""The batched LoRA ops: the torch grouped form against a per-token loop, the Triton SGMV kernels
against the torch form under Triton's interpreter (a subprocess with ``TRITON_INTERPRET=1``, tiny
shapes) and on CUDA (``gpu``: Llama-3.1-8B's shapes, bf16, decode and prefill batches)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pagedllm.lora.mapping import GraphMapping, build_mapping
from pagedllm.lora.punica import add_lora_torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

# (tokens, K in, N out, R stacked rank, slots, dtype): ragged groups, tokens without an adapter,
# split-K (K >> 64), R above one 64-wide block (the expand's R loop), N and K tails, groups of more
# than 64 tokens.
CASES = [
    (7, 64, 48, 16, 3, torch.float32),
    (40, 96, 80, 24, 4, torch.float16),
    (5, 300, 20, 48, 2, torch.float32),
    (70, 128, 130, 96, 5, torch.float32),
    (260, 32, 40, 16, 2, torch.float32),  # groups over 64 tokens: several expand programs, each looping
]


def make_case(tokens, k, n, r, slots, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen).to(device, dtype)
    lora_a = (torch.randn(slots, r, k, generator=gen) * 0.1).to(device, dtype)
    lora_b = (torch.randn(slots, n, r, generator=gen) * 0.1).to(device, dtype)
    y = torch.randn(tokens, n, generator=gen).to(device, dtype)
    token_slots = np.random.RandomState(seed).randint(-1, slots, size=tokens)
    return x, lora_a, lora_b, y, token_slots


def per_token(y, x, lora_a, lora_b, token_slots):
    out = y.float().clone()
    for t, s in enumerate(token_slots):
        if s >= 0:
            out[t] += (x[t].float() @ lora_a[s].float().t()) @ lora_b[s].float().t()
    return out


def test_mapping_groups_tokens_by_slot():
    slots = np.array([2, -1, 0, 2, 2, -1, 0])
    m = build_mapping(slots, torch.device("cpu"))
    assert m.active_slots == [0, 2] and m.starts == [0, 2, 5] and m.max_group_size == 3 and m.num_groups == 2
    assert m.sorted_token_ids.tolist() == [2, 6, 0, 3, 4]
    assert m.starts_dev.tolist() == [0, 2, 5] and m.active_slots_dev.tolist() == [0, 2]
    assert build_mapping(np.array([-1, -1]), torch.device("cpu")) is None


def test_graph_mapping_has_fixed_regions_and_empty_spare_groups():
    graph = GraphMapping(max_tokens=8, max_groups=3, device=torch.device("cpu"))
    graph.stage(np.array([2, -1, 0, 2, 2, -1, 0]))
    m = graph.for_size(8)
    assert m.num_groups == 3 and m.max_group_size == 8
    assert m.sorted_token_ids[:5].tolist() == [2, 6, 0, 3, 4]
    assert m.starts_dev.tolist() == [0, 2, 5, 5] and m.active_slots_dev[:2].tolist() == [0, 2]
    graph.stage(np.array([-1, -1]))  # a step without adapters leaves every group empty
    assert m.starts_dev.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("case", CASES)
def test_grouped_torch_form_equals_a_per_token_loop(case):
    x, lora_a, lora_b, y, token_slots = make_case(*case)
    want = per_token(y, x, lora_a, lora_b, token_slots)
    got = add_lora_torch(y.clone(), x, lora_a, lora_b, build_mapping(token_slots, torch.device("cpu")))
    tol = 1e-5 if case[-1] == torch.float32 else 5e-3
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def check_triton(case, device: str, seed: int = 0, relative: bool = False) -> float:
    """Max abs difference of the Triton kernels from the torch form on one case (``relative``:
    divided by the largest output magnitude)."""
    from pagedllm.lora import kernels

    x, lora_a, lora_b, y, token_slots = make_case(*case, device=device, seed=seed)
    mapping = build_mapping(token_slots, torch.device(device))
    want = add_lora_torch(y.clone(), x, lora_a, lora_b, mapping)
    got = kernels.add_lora_triton(y.clone(), x, lora_a, lora_b, mapping)
    err = (got.float() - want.float()).abs().max().item()
    return err / want.float().abs().max().item() if relative else err


def check_triton_graph_mapping(case, seed: int = 0) -> float:
    """As ``check_triton``, through a ``GraphMapping`` (the fixed grid of a CUDA graph: spare
    groups and rows beyond the step's tokens)."""
    from pagedllm.lora import kernels

    x, lora_a, lora_b, y, token_slots = make_case(*case, seed=seed)
    want = add_lora_torch(y.clone(), x, lora_a, lora_b, build_mapping(token_slots, torch.device("cpu")))
    graph = GraphMapping(max_tokens=len(token_slots) + 9, max_groups=lora_a.shape[0] + 2, device=torch.device("cpu"))
    graph.stage(token_slots)
    got = kernels.add_lora_triton(y.clone(), x, lora_a, lora_b, graph.for_size(len(token_slots) + 3))
    return (got.float() - want.float()).abs().max().item()


# (tokens, K, slice sizes, slice rank, slots, dtype): a merged layer's block-diagonal B; slices
# shorter than, straddling and not aligned to the expand's 128-row tiles.
SLICE_CASES = [
    (9, 64, (256, 128, 128), 16, 3, torch.float32),
    (21, 80, (100, 60, 60), 8, 2, torch.float32),
    (33, 48, (300, 200), 32, 4, torch.float16),
]


def check_triton_slices(case, device: str = "cpu", seed: int = 0) -> float:
    """Max abs difference of the Triton kernels, told the slices, from the torch form over B's
    block-diagonal part, while B holds garbage off its diagonal blocks (which the expand must skip)
    and the shrink writes into a strided column range of a larger zeroed workspace (whose other
    columns must stay zero)."""
    from pagedllm.lora import kernels

    tokens, k, sizes, rank, slots, dtype = case
    n, width = sum(sizes), len(sizes) * rank
    x, lora_a, lora_b, y, token_slots = make_case(tokens, k, n, width, slots, dtype, device, seed)
    starts = tuple(int(v) for v in np.cumsum((0, *sizes[:-1])))
    block_diagonal = torch.zeros_like(lora_b)
    for i, (first, size) in enumerate(zip(starts, sizes)):
        block_diagonal[:, first : first + size, i * rank : (i + 1) * rank] = 1
    mapping = build_mapping(token_slots, torch.device(device))
    want = add_lora_torch(y.clone(), x, lora_a, lora_b * block_diagonal, mapping)
    workspace = torch.zeros(tokens + 2, width + 24, dtype=torch.float32, device=device)
    shrunk = workspace[:tokens, 8 : 8 + width]
    got = kernels.add_lora_triton(y.clone(), x, lora_a, lora_b, mapping, starts, rank, shrunk)
    assert workspace[:, :8].abs().max() == 0 and workspace[:, 8 + width :].abs().max() == 0
    assert workspace[tokens:].abs().max() == 0
    return (got.float() - want.float()).abs().max().item()


_INTERPRETER_SCRIPT = """
import torch
from tests.lora.test_punica import CASES, SLICE_CASES, check_triton, check_triton_graph_mapping, check_triton_slices
for case in CASES:
    limit = 1e-4 if case[-1] == torch.float32 else 1e-2
    err = check_triton(case, "cpu")
    assert err < limit, (case, err)
    err = check_triton_graph_mapping(case)
    assert err < limit, ("graph", case, err)
for case in SLICE_CASES:
    err = check_triton_slices(case)
    assert err < (1e-4 if case[-1] == torch.float32 else 1e-2), ("slices", case, err)
from pagedllm.lora import kernels
kernels.SHRINK_ROW_LOOP_MAX = 64  # the shrink's other launch shape: a program per group's rows
for case in CASES:
    limit = 1e-4 if case[-1] == torch.float32 else 1e-2
    err = max(check_triton(case, "cpu"), check_triton_graph_mapping(case))
    assert err < limit, ("shrink row loop", case, err)
print("ok", len(CASES) + len(SLICE_CASES))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_triton_kernels_equal_the_torch_form_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and f"ok {len(CASES) + len(SLICE_CASES)}" in proc.stdout, proc.stdout + proc.stderr


needs_cuda = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs Triton and CUDA")

# Llama-3.1-8B's LoRA layers at rank 16 (qkv and gate_up stack 3 and 2 slices), 8 adapters, a decode
# batch of 64 and a prefill of 2048 tokens.
GPU_SHAPES = [(4096, 6144, 48), (4096, 4096, 16), (4096, 28672, 32), (14336, 4096, 16)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 64, 2048])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_triton_kernels_on_cuda(shape, tokens):
    k, n, r = shape
    err = check_triton((tokens, k, n, r, 8, torch.bfloat16), "cuda", relative=True)
    # Outputs reach |y| ~ 20, where one bf16 ulp is 0.125: the kernels keep the shrunk rows in
    # float32 while the torch form rounds them to bf16, so the two differ by a few output ulps.
    assert err < 2e-2, err


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [64, 2048])
@pytest.mark.parametrize("sizes", [(4096, 1024, 1024), (14336, 14336)])
def test_triton_slices_on_cuda(sizes, tokens):
    """Llama-3.1-8B's merged qkv and gate_up at rank 16: the expand reads only each row's slice."""
    err = check_triton_slices((tokens, 4096, sizes, 16, 8, torch.bfloat16), "cuda")
    assert err < 0.25, err  # a few bf16 ulps of outputs up to ~30 (see test_triton_kernels_on_cuda)


@pytest.mark.gpu
@needs_cuda
def test_graph_mapping_stage_does_not_wait_for_the_gpu():
    """Staging a decode step's grouping is a non-blocking copy: the host goes on while the GPU is
    still busy with earlier work (a blocking copy would wait for it: the old code)."""
    import time

    graph = GraphMapping(max_tokens=64, max_groups=8, device=torch.device("cuda"))
    token_slots = np.repeat(np.arange(8), 8)
    graph.stage(token_slots)
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # a few hundred milliseconds of GPU work
    t0 = time.perf_counter()
    graph.stage(token_slots[::-1].copy())
    graph.stage(token_slots)  # back to the first host set: its copy finished before the sleep
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert elapsed < 0.05, elapsed
    assert graph.buffer[:64].tolist() == list(range(64))
