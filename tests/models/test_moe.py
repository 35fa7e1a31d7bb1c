"""Mixtral, Qwen3-MoE and Qwen2-MoE (models/moe.py) against transformers on the same tiny random
weights, in float32 on the CPU: logits of single, ragged, chunked, prefix-hit and decode steps; the
residual-stream form; greedy ids of the engine (chunked prefill, prefix caching, preemption) equal
to ``generate``; what the loader and the config refuse."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import EngineArgs, SamplingParams
from pagedllm.config import ParallelConfig, moe_sizes
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.loader import load_hf_config, resolve_model
from pagedllm.models import build_model, get_model_class, load_model
from tests.engine.reference import assert_greedy_match, hf_greedy
from tests.helpers import PagedTestRunner
from tests.models.moe_tiny import MOE_ARCHS, VOCAB, make_tiny_moe, tiny_moe_config

ATOL = 1e-4


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < ATOL * max(1.0, ref.abs().max().item() / 10), f"max |ours - hf| = {diff:.3g}"


class TinyMoe:
    def __init__(self, arch: str, folder) -> None:
        from transformers import AutoModelForCausalLM

        self.arch = arch
        self.folder = make_tiny_moe(arch, folder)
        self.source = resolve_model(self.folder)
        self.hf_config = load_hf_config(self.source)
        self.model = load_model(self.source, self.hf_config, torch.float32, "cpu")
        self.hf = AutoModelForCausalLM.from_pretrained(self.folder, dtype=torch.float32).eval()
        gen = torch.Generator().manual_seed(1)
        self.prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (13, 7, 21)]

    @torch.no_grad()
    def ref_logits(self, ids: list[int]) -> torch.Tensor:
        return self.hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module", params=MOE_ARCHS)
def tiny(request, tmp_path_factory) -> TinyMoe:
    return TinyMoe(request.param, tmp_path_factory.mktemp(request.param))


def test_the_architecture_table_serves_each_moe_class(tiny):
    assert get_model_class(tiny.hf_config).__name__ == "MoeForCausalLM"
    blocks = [m for m in tiny.model.modules() if isinstance(m, FusedMoE)]
    sparse = {"mixtral": 3, "qwen3_moe": 2, "qwen2_moe": 1}[tiny.arch]  # dense layers: mlp_only / sparse step
    assert len(blocks) == sparse
    assert all(b.renormalize == (tiny.arch != "qwen2_moe") for b in blocks)
    experts, size = moe_sizes(tiny.hf_config)
    assert blocks[0].w13_weight.shape == (experts, 2 * size, 64) and blocks[0].w2_weight.shape == (experts, 64, size)


def test_ragged_batch_logits(tiny):
    outs = PagedTestRunner(tiny.model).step([(i, p) for i, p in enumerate(tiny.prompts)])
    for out, p in zip(outs, tiny.prompts):
        assert_logits_close(out, tiny.ref_logits(p))


def test_chunks_prefix_hit_and_decode(tiny):
    p0, p1 = tiny.prompts[2], tiny.prompts[1]
    runner = PagedTestRunner(tiny.model, num_blocks=128, block_size=4)
    (a,) = runner.step([(0, p0[:8])])
    b, c = runner.step([(0, p0[8:15]), (1, p1)])
    (d,) = runner.step([(0, p0[15:])])
    assert_logits_close(torch.cat([a, b, d]), tiny.ref_logits(p0))
    assert_logits_close(c, tiny.ref_logits(p1))
    runner.fork(0, 2, 12)
    tail = tiny.prompts[0][:5]
    (e,) = runner.step([(2, tail)])
    assert_logits_close(e, tiny.ref_logits(p0[:12] + tail)[12:])
    seqs, tokens = [list(p0), list(p1)], [int(d[-1].argmax()), int(c[-1].argmax())]
    for _ in range(3):  # decode: one row per request
        for seq, t in zip(seqs, tokens):
            seq.append(t)
        outs = runner.step([(i, [t]) for i, t in enumerate(tokens)])
        tokens = [int(o[-1].argmax()) for o in outs]
    for seq, out in zip(seqs, outs):
        assert_logits_close(out, tiny.ref_logits(seq)[-1:])


def test_folded_norms_and_the_residual_stream_form(tiny):
    """The MoE block reads the stream itself (its norm is not folded: it feeds router and experts)."""
    from pagedllm.layers import fold_norms

    model = load_model(tiny.source, tiny.hf_config, torch.float32, "cpu")
    if not fold_norms(model):
        assert tiny.arch == "qwen2_moe"  # qkv bias: nothing folds
        return
    model.model.residual.use_stream_from(3)
    outs = PagedTestRunner(model).step([(i, p) for i, p in enumerate(tiny.prompts)])
    for out, p in zip(outs, tiny.prompts):
        assert_logits_close(out, tiny.ref_logits(p))


def test_missing_and_unexpected_expert_weights_are_named(tiny):
    from pagedllm.loader import iter_weights

    model = build_model(tiny.hf_config, torch.float32, "cpu")
    weights = [(n, w) for n, w in iter_weights(tiny.source) if ".experts.1." not in n]
    block = "block_sparse_moe.experts.99.w1" if tiny.arch == "mixtral" else "mlp.experts.99.gate_proj"
    layer = 1 if tiny.arch == "qwen2_moe" else 0  # an MoE layer
    weights.append((f"model.layers.{layer}.{block}.weight", torch.zeros(1)))
    with pytest.raises(ValueError, match=r"expert 99 is not one of the model's"):
        model.load_weights(weights)
    with pytest.raises(ValueError, match=r"missing weights \[.*experts.w13_weight\[\(1, 'gate'\)\]"):
        model.load_weights(weights[:-1])


# ---- the engine's greedy ids against generate --------------------------------------------------

def make_prompts(n: int = 8) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, VOCAB) for _ in range(20)]
    prompts = [(shared if i % 2 == 0 else []) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))]
               for i in range(n)]
    return prompts, [rng.randint(4, 12) for _ in range(n)]


def test_engine_greedy_ids_equal_generate_under_chunks_prefix_hits_and_preemption(tiny):
    engine_config = dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_gpu_blocks_override=24)
    prompts, max_tokens = make_prompts()
    refs = [hf_greedy(tiny.hf, p, m) for p, m in zip(prompts, max_tokens)]
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny.folder, dtype="float32", skip_tokenizer_init=True,
                                                   **engine_config))
    for i, p in enumerate(prompts[:2]):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=max_tokens[i],
                                                                             ignore_eos=True, detokenize=False))
    done: dict[str, list[int]] = {}
    for step in range(1000):
        if step == 2:  # later requests join a running batch and hit the shared prefix's blocks
            for i in range(2, len(prompts)):
                engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i]},
                                   SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True,
                                                  detokenize=False))
        if step > 2 and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        engine.engine_core.scheduler.check_integrity()
    stats = engine.engine_core.scheduler.stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions_total > 0
    for i, (p, r) in enumerate(zip(prompts, refs)):
        assert_greedy_match(tiny.hf, p, done[f"r{i}"], r, f"{tiny.arch}/r{i}")


# ---- what is refused ---------------------------------------------------------------------------

def test_quantization_is_refused_for_moe_models(tmp_path):
    folder = make_tiny_moe("mixtral", tmp_path / "m")
    with pytest.raises(ValueError, match="^quantization is not supported for 'mixtral'"):
        LLMEngine.from_engine_args(EngineArgs(model=folder, dtype="float32", skip_tokenizer_init=True,
                                              quantization="fp8"))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_parallel_sizes_that_do_not_divide_the_experts_are_refused(arch):
    cfg = tiny_moe_config(arch, **{"num_local_experts" if arch == "mixtral" else "num_experts": 6})
    experts = moe_sizes(cfg)[0]
    assert experts == 6
    ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True).verify_model(cfg)
    ParallelConfig(tensor_parallel_size=2).verify_model(cfg)  # every expert's intermediate dim splits in two
    with pytest.raises(ValueError, match=rf"^tensor_parallel_size \(4\) must divide the model's number of experts "
                                         rf"\({experts}\) with enable_expert_parallel"):
        ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True).verify_model(cfg)


def test_odd_expert_sizes_split_only_under_expert_parallel():
    cfg = tiny_moe_config("qwen3_moe", moe_intermediate_size=33)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size \(2\) must divide the model's expert "
                                         r"intermediate size \(33\)"):
        ParallelConfig(tensor_parallel_size=2).verify_model(cfg)
    ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True).verify_model(cfg)  # whole experts
    shared = tiny_moe_config("qwen2_moe", shared_expert_intermediate_size=49)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size \(2\) must divide the model's "
                                         r"shared_expert_intermediate_size \(49\)"):
        ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True).verify_model(shared)


def test_expert_parallel_is_refused_for_a_dense_model():
    from tests.helpers import tiny_config

    with pytest.raises(ValueError, match="^enable_expert_parallel: the model has no experts"):
        ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True).verify_model(tiny_config("llama"))
    with pytest.raises(ValueError, match="^enable_expert_parallel must be a boolean"):
        EngineArgs(enable_expert_parallel="yes")


# ---- CUDA (the lead runs these on a GPU) --------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_cuda_engine_greedy_ids_equal_generate(arch, tmp_path):
    """The fused-MoE Triton path in the engine on CUDA (decode steps replayed from CUDA graphs),
    float32, against transformers on the CPU."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_moe(arch, tmp_path / arch)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts, max_tokens = make_prompts()
    engine = LLMEngine.from_engine_args(EngineArgs(model=folder, dtype="float32", skip_tokenizer_init=True,
                                                   device="cuda"))
    worker = engine.engine_core.executor.worker
    assert {worker.kernel_plan.impls[n] for n, m in worker.model.named_modules() if isinstance(m, FusedMoE)} == {"cuda"}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=max_tokens[i],
                                                                             ignore_eos=True, detokenize=False))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        assert_greedy_match(hf, p, done[f"r{i}"], hf_greedy(hf, p, m), f"{arch}/cuda/r{i}")
