"""Multi-LoRA end to end on the CPU: greedy ids and logprobs equal transformers + PEFT for every
adapter of one mixed batch (the base model and three adapters, more than ``max_loras`` and
``max_cpu_loras``: slots and the CPU cache evict), with chunked prefill; the prefix cache is never
shared across adapters; bad adapters and misuse are refused with errors naming the field."""

from __future__ import annotations

import random

import pytest

from pagedllm import EngineArgs, LoRARequest, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from tests.lora.adapters import PeftReference, make_adapter, make_base_model

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_base_model(root / "base")
    adapters = {
        "all": make_adapter(base, root / "all", seed=1, rank=8),
        "some": make_adapter(base, root / "some", seed=2, rank=4, targets=("q_proj", "v_proj", "down_proj")),
        "rslora": make_adapter(base, root / "rslora", seed=3, rank=8, alpha=4, use_rslora=True,
                               targets=("k_proj", "o_proj", "gate_proj", "up_proj")),
    }
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randint(3, 30))] for _ in range(3)]
    return base, adapters, prompts, PeftReference(base, adapters)


def engine_args(base: str, **kwargs) -> EngineArgs:
    return EngineArgs(model=base, dtype="float32", skip_tokenizer_init=True, **kwargs)


def lora_requests(adapters: dict[str, str]) -> dict[str | None, LoRARequest | None]:
    return {None: None, **{name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}}


def run(engine: LLMEngine, jobs: list[tuple[str, list[int], LoRARequest | None]]) -> dict[str, tuple]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    for req_id, prompt, lora in jobs:
        engine.add_request(req_id, {"prompt_token_ids": prompt}, params, lora_request=lora)
    results = {}
    scheduler = engine.engine_core.scheduler
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                results[out.request_id] = (c.token_ids, [next(iter(d.values())).logprob for d in c.logprobs],
                                           out.num_cached_tokens)
        scheduler.check_integrity()
    assert scheduler.block_pool.get_usage() == 0.0
    return results


def test_mixed_batch_equals_peft_per_adapter_with_eviction(setup):
    base, adapters, prompts, reference = setup
    engine = LLMEngine.from_engine_args(engine_args(base, enable_lora=True, max_loras=2, max_cpu_loras=2,
                                                    max_lora_rank=8, max_num_batched_tokens=24, max_num_seqs=6))
    loras = lora_requests(adapters)
    names = [None, "all", "some", "rslora"]
    jobs = [(f"{name}-{i}", p, loras[name]) for i, p in enumerate(prompts) for name in names]
    random.Random(1).shuffle(jobs)
    results = run(engine, jobs)
    for name in names:
        for i, prompt in enumerate(prompts):
            reference.check(name, prompt, *results[f"{name}-{i}"][:2])
    manager = engine.engine_core.runner.lora_manager
    assert len(manager.cpu_cache) <= 2 and sum(s is not None for s in manager.slot_ids) <= 2


def test_llm_generate_takes_one_lora_request_per_prompt(setup):
    from pagedllm import LLM

    base, adapters, prompts, reference = setup
    llm = LLM(base, dtype="float32", skip_tokenizer_init=True, enable_lora=True, max_loras=3, max_lora_rank=8)
    loras = lora_requests(adapters)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    names = [None, "all", "some"]
    outs = llm.generate([prompts[0]] * 3, params, lora_request=[loras[n] for n in names], use_tqdm=False)
    for name, out in zip(names, outs):
        reference.check(name, prompts[0], out.outputs[0].token_ids, _chosen_logprobs(out))
    one = llm.generate(prompts[1], params, lora_request=loras["rslora"], use_tqdm=False)[0]
    reference.check("rslora", prompts[1], one.outputs[0].token_ids, _chosen_logprobs(one))
    with pytest.raises(ValueError, match="^lora_request must be one LoRARequest or one per prompt"):
        llm.generate([prompts[0]] * 2, params, lora_request=[None])


def _chosen_logprobs(out) -> list[float]:
    return [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]


def test_prefix_cache_is_not_shared_across_adapters(setup):
    base, adapters, _, reference = setup
    prompt = list(range(100, 140))  # two full blocks of 16
    engine = LLMEngine.from_engine_args(engine_args(base, enable_lora=True, max_loras=2, max_lora_rank=8))
    loras = lora_requests(adapters)
    first = run(engine, [("all-1", prompt, loras["all"])])
    later = run(engine, [("some", prompt, loras["some"]), ("base", prompt, None)])
    again = run(engine, [("all-2", prompt, loras["all"])])
    assert first["all-1"][2] == 0 and later["some"][2] == 0 and later["base"][2] == 0
    assert again["all-2"][2] == 32  # the same adapter hits its own blocks
    for name, result in [("all", first["all-1"]), ("all", again["all-2"]), ("some", later["some"]),
                         (None, later["base"])]:
        reference.check(name, prompt, *result[:2])


@pytest.fixture(scope="module")
def engine(setup):
    return LLMEngine.from_engine_args(engine_args(setup[0], enable_lora=True, max_lora_rank=8))


def _add(engine: LLMEngine, lora, req_id: str = "bad") -> None:
    engine.add_request(req_id, {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), lora_request=lora)


def test_bad_adapters_are_refused_naming_the_field(setup, engine, tmp_path):
    base = setup[0]
    cases = [
        (make_adapter(base, tmp_path / "r16", seed=4, rank=16), r"rank 16, above max_lora_rank \(8\)"),
        (make_adapter(base, tmp_path / "head", seed=5, targets=("q_proj", "lm_head")), "targets \\['lm_head'\\]"),
        (make_adapter(base, tmp_path / "emb", seed=6, targets=("embed_tokens",)), "targets \\['embed_tokens'\\]"),
        (make_adapter(base, tmp_path / "save", seed=7, targets=("q_proj",), modules_to_save=["lm_head"]),
         "modules_to_save"),
        (str(tmp_path / "missing"), "not a PEFT adapter folder"),
    ]
    for i, (path, message) in enumerate(cases):
        with pytest.raises(ValueError, match=f"^lora_request: .*{message}"):
            _add(engine, LoRARequest(f"bad{i}", 100 + i, path))
    with pytest.raises(TypeError, match="^lora_request must be a LoRARequest"):
        _add(engine, "all")
    good = setup[1]["all"]
    _add(engine, LoRARequest("all", 1, good), "ok")
    with pytest.raises(ValueError, match="^lora_request: lora_int_id 1 already names"):
        _add(engine, LoRARequest("other", 1, setup[1]["some"]))
    while engine.has_unfinished_requests():
        engine.step()
    engine.engine_core.scheduler.check_integrity()
    assert engine.engine_core.scheduler.block_pool.get_usage() == 0.0


def test_lora_request_without_enable_lora_is_refused(setup):
    engine = LLMEngine.from_engine_args(engine_args(setup[0]))
    with pytest.raises(ValueError, match="^lora_request needs LoRA, which is off: .*enable_lora"):
        _add(engine, LoRARequest("all", 1, setup[1]["all"]))
    assert engine.engine_core.runner.lora_manager is None
    assert all(m.lora is None for m in engine.engine_core.runner.model.modules() if hasattr(m, "lora"))


def test_lora_on_a_moe_model_is_refused(tmp_path):
    import json

    from tests.lora.adapters import make_base_model

    folder = make_base_model(tmp_path / "moe")
    config_file = tmp_path / "moe" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "num_local_experts": 4}))
    with pytest.raises(ValueError, match="^enable_lora is not supported for mixture-of-experts models"):
        LLMEngine.from_engine_args(engine_args(folder, enable_lora=True))


@pytest.mark.parametrize("kwargs,message", [
    ({"max_lora_rank": 12}, "^max_lora_rank must be one of"),
    ({"max_loras": 0}, "^max_loras must be a positive integer"),
    ({"max_loras": 4, "max_cpu_loras": 2}, r"^max_cpu_loras \(2\) must be >= max_loras \(4\)"),
    ({"enable_lora": True, "tensor_parallel_size": 2}, "^enable_lora is not supported with tensor_parallel_size"),
])
def test_lora_engine_args_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)
