"""The fused MoE layer (layers/fused_moe.py): the router's normalisations; the grouped CPU loop
against a dense per-token reference; the tensor-parallel and expert-parallel splits (ranks simulated
in one process) summing to the unsplit layer; the Triton grouped GEMM (layers/kernels/fused_moe.py)
against the CPU loop under Triton's interpreter (a subprocess with ``TRITON_INTERPRET=1``), and on
CUDA (``gpu``: Qwen3-30B-A3B and Mixtral shapes, a captured CUDA graph)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pagedllm.distributed import TensorParallelGroup, set_tp_group
from pagedllm.layers.fused_moe import FusedMoE, grouped_experts, select_experts

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs Triton and CUDA")


def dense_reference(x, w13, w2, weights, ids):
    """Every token, every chosen expert, one at a time (float64)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += float(weights[t, j]) * (w2[e].double() @ (F.silu(gate) * up))
    return out


def random_experts(num_tokens=11, hidden=32, inter=24, experts=6, top_k=2, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    logits = torch.randn(num_tokens, experts, generator=gen)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), logits


# ---- routing -----------------------------------------------------------------------------------

def test_renormalized_top_k_is_the_softmax_of_the_top_k_logits():
    """Mixtral's routing: softmax over all, top-k, renormalised == softmax over the top-k logits."""
    logits = torch.randn(9, 8)
    weights, ids = select_experts(logits, 2, renormalize=True)
    top_logits = logits.gather(1, ids)
    torch.testing.assert_close(weights, torch.softmax(top_logits, -1))
    assert torch.equal(ids, logits.topk(2, -1).indices)
    assert weights.dtype == torch.float32


def test_without_renormalizing_the_weights_are_the_full_softmax_probabilities():
    """Qwen's ``norm_topk_prob=False``: the chosen experts keep their share of the full softmax."""
    logits = torch.randn(5, 8, dtype=torch.bfloat16)
    weights, ids = select_experts(logits, 3, renormalize=False)
    probs = torch.softmax(logits.float(), -1)
    torch.testing.assert_close(weights, probs.gather(1, ids))
    assert (weights.sum(-1) < 1).all() and weights.dtype == torch.float32
    renormed, _ = select_experts(logits, 3, renormalize=True)
    torch.testing.assert_close(renormed.sum(-1), torch.ones(5))


def test_ties_go_to_the_lower_expert_as_in_transformers():
    weights, ids = select_experts(torch.zeros(2, 4), 2, renormalize=True)
    assert ids.tolist() == torch.zeros(2, 4).topk(2, -1).indices.tolist()
    torch.testing.assert_close(weights, torch.full((2, 2), 0.5))


# ---- the CPU loop and the parallel splits --------------------------------------------------------

def test_grouped_loop_equals_the_dense_reference_and_skips_idle_experts(monkeypatch):
    x, w13, w2, logits = random_experts(experts=8, top_k=2)
    logits[:, 5] = -1e9  # expert 5 receives no token
    weights, ids = select_experts(logits, 2, renormalize=False)
    calls = []
    real_linear = F.linear
    monkeypatch.setattr(F, "linear", lambda a, w, *b: calls.append(w.data_ptr()) or real_linear(a, w, *b))
    got = grouped_experts(x, w13, w2, weights, ids)
    monkeypatch.undo()
    torch.testing.assert_close(got.double(), dense_reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    active = set(ids.flatten().tolist())
    assert 5 not in active and len(calls) == 2 * len(active)  # one gate_up and one down per active expert


class LocalRank(TensorParallelGroup):
    """A rank of a simulated group: its all-reduce is left to the test."""

    def all_reduce(self, x):
        return x


def load_layer(layer: FusedMoE, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Feed ``layer`` the checkpoint's per-expert matrices, as the model's loader does."""
    inter = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        for role, tensor in (("gate", w13[e, :inter]), ("up", w13[e, inter:])):
            layer.w13_weight.weight_loader(layer.w13_weight, tensor, (e, role))
        layer.w2_weight.weight_loader(layer.w2_weight, w2[e], (e, "down"))


def build_rank(rank, size, expert_parallel, **kwargs) -> FusedMoE:
    previous = set_tp_group(LocalRank(rank, size, expert_parallel=expert_parallel))
    try:
        return FusedMoE(**kwargs)
    finally:
        set_tp_group(previous)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sliced", "expert_parallel"])
def test_ranks_sum_to_the_unsplit_layer(expert_parallel):
    x, w13, w2, logits = random_experts(experts=6, top_k=3, inter=24)
    args = dict(num_experts=6, top_k=3, hidden_size=32, intermediate_size=24, renormalize=True)
    whole = FusedMoE(**args)
    load_layer(whole, w13, w2)
    ranks = [build_rank(r, 2, expert_parallel, **args) for r in range(2)]
    for layer in ranks:
        load_layer(layer, w13, w2)
    if expert_parallel:
        assert [(r.first_expert, r.num_local_experts, r.intermediate_size) for r in ranks] == [(0, 3, 24), (3, 3, 24)]
        assert ranks[1].w13_weight.shard_ids[0] == (3, "gate")
    else:
        assert [r.w13_weight.shape for r in ranks] == [(6, 24, 32)] * 2
        torch.testing.assert_close(ranks[1].w13_weight[:, 12:], w13[:, 36:])  # rank 1's half of up
    want = whole(x, logits)
    torch.testing.assert_close(ranks[0](x, logits) + ranks[1](x, logits), want, atol=1e-5, rtol=1e-5)


def test_sizes_that_do_not_split_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"^num_experts \(expert parallel\) \(6\) must be divisible"):
        build_rank(0, 4, True, num_experts=6, top_k=2, hidden_size=8, intermediate_size=8, renormalize=True)
    with pytest.raises(ValueError, match=r"^the experts' intermediate size \(6\) must be divisible"):
        build_rank(0, 4, False, num_experts=8, top_k=2, hidden_size=8, intermediate_size=6, renormalize=True)
    with pytest.raises(ValueError, match=r"^num_experts_per_tok \(9\) must not exceed"):
        FusedMoE(num_experts=8, top_k=9, hidden_size=8, intermediate_size=8, renormalize=True)
    layer = FusedMoE(num_experts=2, top_k=1, hidden_size=8, intermediate_size=4, renormalize=True)
    with pytest.raises(ValueError, match=r"weight shape \(4, 4\) does not match expert gate \(4, 8\)"):
        layer.w13_weight.weight_loader(layer.w13_weight, torch.zeros(4, 4), (0, "gate"))


# ---- the Triton grouped GEMM --------------------------------------------------------------------

def test_launch_parameters_follow_the_mean_assignments_per_expert():
    from pagedllm.layers.tuning import HOPPER

    narrow, small, large = (config for _, config in HOPPER.moe_gemm_configs)
    assert HOPPER.moe_gemm_config(8, 128) == narrow  # Qwen3-30B-A3B decode at batch 1
    assert HOPPER.moe_gemm_config(64 * 8, 128) == small  # batch 64: 4 assignments per expert
    assert HOPPER.moe_gemm_config(4096 * 8, 128) == large  # a prefill chunk
    assert narrow[1] < small[1] and small[0] < large[0]
    # Up to one assignment per expert on average: the direct GEMVs (no sorting).
    assert HOPPER.moe_runs_direct(16 * 8, 128) and not HOPPER.moe_runs_direct(17 * 8, 128)
    assert HOPPER.moe_runs_direct(2 * 2, 8) and not HOPPER.moe_runs_direct(5 * 2, 8)


# (tokens, hidden, intermediate, experts, top_k, dtype, launch config, expert-parallel (first, count) or None):
# one token; ragged K / N tails; more tokens than one block per expert; grouped program order; fp16;
# a rank holding experts 2..5 of 8.
INTERPRETER_CASES = [
    (1, 64, 32, 8, 2, torch.float32, (16, 16, 32, 1, 4, 1), None),
    (5, 40, 24, 4, 2, torch.float32, (16, 16, 16, 1, 4, 1), None),
    (37, 32, 32, 6, 3, torch.float32, (16, 32, 16, 4, 4, 1), None),
    (20, 32, 48, 4, 2, torch.float16, (16, 32, 32, 2, 4, 1), None),
    (9, 32, 32, 8, 2, torch.float32, (16, 32, 32, 1, 4, 1), (2, 4)),
]


# The direct (GEMV) path: (tokens, hidden, intermediate, experts, top_k, dtype, (block_n, block_k,
# num_warps), expert-parallel or None): ragged column and K tails; a token choosing another rank's experts.
DIRECT_CASES = [
    (1, 64, 32, 8, 2, torch.float32, (16, 32, 4), None),
    (3, 40, 24, 4, 2, torch.float32, (16, 16, 4), None),
    (2, 32, 48, 4, 2, torch.float16, (32, 32, 4), None),
    (4, 32, 32, 8, 2, torch.float32, (16, 32, 4), (2, 4)),
]


def check_kernel_case(case, device: str, seed: int = 0, direct: bool = False) -> float:
    """Relative max error of ``fused_experts`` (``direct``: ``fused_experts_direct``) against the
    grouped loop (float32) for one case."""
    from pagedllm.layers.kernels.fused_moe import fused_experts, fused_experts_direct

    tokens, hidden, inter, experts, top_k, dtype, config, ep = case
    x, w13, w2, logits = random_experts(tokens, hidden, inter, experts, top_k, seed, dtype)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    first, count = ep if ep is not None else (0, experts)
    w13, w2 = w13[first:first + count].contiguous(), w2[first:first + count].contiguous()
    want = grouped_experts(x.float(), w13.float(), w2.float(), weights, ids, first)
    to = lambda t: t.to(device)  # noqa: E731
    if direct:
        got = fused_experts_direct(to(x), to(w13), to(w2), to(weights), to(ids), first, config)
    else:
        got = fused_experts(to(x), to(w13), to(w2), to(weights), to(ids), first, ep is not None, config)
    assert got.dtype == dtype and got.shape == x.shape
    return float((got.float().cpu() - want).abs().max() / want.abs().max())


def _interpreter_main() -> None:
    from pagedllm.layers.kernels.fused_moe import align_assignments

    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])  # 6 assignments; experts 0: 2, 1: 1, 3: 3
    sorted_ids, block_expert, num_padded = align_assignments(ids, 4, 0, 4)
    assert num_padded.item() == 12 and sorted_ids.numel() == 6 + 4 * 3 + 2  # rounded up to whole blocks
    runs = sorted_ids[:12].view(3, 4).tolist()  # within an expert's run the order is free
    assert [sorted(run) for run in runs] == [[1, 4, 6, 6], [3, 6, 6, 6], [0, 2, 5, 6]]
    assert block_expert[:3].tolist() == [0, 1, 3]
    sorted_ids, block_expert, num_padded = align_assignments(ids, 2, 2, 4)  # a rank holding experts 2, 3
    assert num_padded.item() == 4 and sorted(sorted_ids[:4].tolist()) == [0, 2, 5, 6] and block_expert[0] == 1
    for case in INTERPRETER_CASES:
        err = check_kernel_case(case, "cpu")
        assert err < (1e-5 if case[5] == torch.float32 else 2e-3), (case, err)
        print("ok", case[:5], err)
    for case in DIRECT_CASES:
        err = check_kernel_case(case, "cpu", direct=True)
        assert err < (1e-5 if case[5] == torch.float32 else 2e-3), (case, err)
        print("ok direct", case[:5], err)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_grouped_gemm_matches_the_cpu_loop_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    code = f"import runpy; runpy.run_path({__file__!r})['_interpreter_main']()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("ok") == len(INTERPRETER_CASES) + len(DIRECT_CASES)


# ---- CUDA (the lead runs these on a GPU) --------------------------------------------------------

# Qwen3-30B-A3B (128 experts, top 8, hidden 2048, expert size 768) and Mixtral-8x7B (8, top 2, 4096,
# 14336 / 4 as under tensor parallel 4).
GPU_SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-tp4": (4096, 3584, 8, 2)}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_grouped_gemm_matches_the_cpu_loop_on_cuda(shape):
    from pagedllm.layers.tuning import HOPPER

    hidden, inter, experts, top_k = GPU_SHAPES[shape]
    for tokens in (1, 3, 64, 257):
        config = HOPPER.moe_gemm_config(tokens * top_k, experts)
        err = check_kernel_case((tokens, hidden, inter, experts, top_k, torch.bfloat16, config, None), "cuda")
        assert err < 2e-2, (tokens, err)
    for tokens in (1, 2, 5):
        err = check_kernel_case((tokens, hidden, inter, experts, top_k, torch.bfloat16, HOPPER.moe_gemv_config, None),
                                "cuda", direct=True)
        assert err < 2e-2, (tokens, err)
    err = check_kernel_case((3, hidden, inter, experts, top_k, torch.bfloat16, HOPPER.moe_gemv_config,
                             (experts // 2, experts // 2)), "cuda", direct=True)
    assert err < 2e-2, err
    err = check_kernel_case((64, hidden, inter, experts, top_k, torch.bfloat16, HOPPER.moe_gemm_configs[-1][1],
                             (experts // 2, experts // 2)), "cuda")
    assert err < 2e-2, err


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [64, 1])  # the grouped GEMM; the direct GEMVs
def test_the_layer_replays_in_a_cuda_graph(rows):
    from pagedllm.layers.kernel_plan import KernelPlan

    hidden, inter, experts, top_k = GPU_SHAPES["qwen3-30b-a3b"]
    layer = FusedMoE(experts, top_k, hidden, inter, renormalize=True).cuda().to(torch.bfloat16)
    with torch.no_grad():
        layer.w13_weight.normal_(0, 0.02)
        layer.w2_weight.normal_(0, 0.02)
    from pagedllm.config import KernelConfig
    from pagedllm.layers.gemm_library import GemmLibrary
    from pagedllm.layers.tuning import HOPPER

    assert layer.select(KernelPlan(torch.device("cuda"), KernelConfig(), HOPPER, GemmLibrary(0.03))) == "cuda"
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(rows, experts, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = layer(x, logits).clone()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x, logits)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, layer.forward_native(x, logits), atol=2e-2, rtol=2e-2)
    assert not torch.equal(out, eager)  # the replay read the new input
