"""Beam search over an AsyncLLMEngine: the asyncio driver of ``pagedllm.beam_search``.

Each step submits every live beam as a one-token request (``2 * beam_width`` logprobs, no
detokenization) and awaits them together, so the beams of all prompts form one engine batch and
other requests keep running beside them. Same search, same results as ``LLM.beam_search``.
"""

from __future__ import annotations

import asyncio
import itertools

from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search_async
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


async def beam_search(engine: AsyncLLMEngine, prompts: list[list[int]], params: BeamSearchParams,
                      request_id: str, priority: int = 0) -> list[BeamSearchOutput]:
    """One BeamSearchOutput per prompt (token ids), its ``beam_width`` best beams first.

    Beam texts are left to the caller (``text`` is None). Every beam request has ``priority``;
    add_request's ValueError/TypeError propagate. Cancelling the coroutine aborts the
    step's requests (their streams abort on close), so no KV block outlives it.
    """
    step_params = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature,
                                 detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
    counter = itertools.count()

    async def one_beam(tokens: list[int]) -> dict[int, Logprob]:
        final = None
        async for out in engine.generate({"prompt_token_ids": tokens}, step_params,
                                         f"{request_id}-beam-{next(counter)}", priority=priority):
            final = out
        return (final.outputs[0].logprobs or [{}])[0] if final is not None else {}

    async def step(beams: list[list[int]]) -> list[dict[int, Logprob]]:
        return list(await asyncio.gather(*(one_beam(b) for b in beams)))

    model_config = engine.get_model_config()
    return await run_beam_search_async(step, prompts, params, _eos_token_id(engine), model_config.max_model_len)


def _eos_token_id(engine: AsyncLLMEngine) -> int | None:
    """The EOS id as ``LLMEngine`` picks it: the model config's (the first of a list), else the tokenizer's."""
    eos = getattr(engine.get_model_config().hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    tokenizer = engine.get_tokenizer()
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return eos
