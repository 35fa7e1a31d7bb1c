"""Shared set-up of the GPU decode profiles: an engine (random weights) holding ``batch`` requests
of ``ctx`` random prompt tokens each, stepped until every prompt is prefilled and a few decode
steps have run, so the next steps are steady decode at about ``ctx`` tokens of context."""

import random

from pagedllm import LLM, SamplingParams


def decoding_engine(batch: int, ctx: int, temperature: float = 0.6, max_tokens: int = 400,
                    model: str = "benchmarks/configs/qwen3-0.6b", decode_steps: int = 6, **engine_args):
    """Returns ``(llm, engine)``; ``max_tokens`` bounds how many steps the caller can still run;
    ``engine_args`` go to ``LLM`` (e.g. ``kv_cache_dtype``)."""
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, **engine_args)
    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    for i in range(batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": [rng.randint(0, 10000) for _ in range(ctx)]}, params)
    scheduler = engine.engine_core.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    for _ in range(decode_steps):
        engine.step()
    return llm, engine
