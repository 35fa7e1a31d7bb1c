"""LLM: offline batch generation and chat (vLLM-compatible front door)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tqdm.auto import tqdm

from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from pagedllm.config import EngineArgs
from pagedllm.engine.input_processor import batch_token_ids, tokenize_prompt
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.metrics_reader import Metric
from pagedllm.entrypoints.chat_utils import apply_chat_template
from pagedllm.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

# Texts tokenized per batched call when ``LLM.encode`` tokenizes ahead of the engine: large enough for
# the tokenizer's threads, small enough that the first chunk (not overlapped) is short.
_TOKENIZE_CHUNK = 512


class LLM:
    """``LLM()`` loads the embedded default model; ``LLM("folder" | "file.gguf" | "org/name", **engine_args)``."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("disable_log_stats", True)  # as vLLM: offline runs log no stats unless asked
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs), usage_context="LLM_CLASS")
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics as vLLM's reader objects (``Counter``, ``Gauge``, ``Histogram`` with
        ``.name``, ``.labels`` and ``.value`` / ``.count``, ``.sum``, ``.buckets``), named
        ``pagedllm:...`` as the server's Prometheus metrics. Needs ``LLM(..., disable_log_stats=False)``
        (RuntimeError otherwise)."""
        return self.llm_engine.get_metrics()

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list; outputs come back in input order. ``lora_request``: one
        ``LoRARequest`` for every prompt, or a list with one per prompt (None: the base model)."""
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompts), SamplingParams, "sampling_params")
        return self._add_and_run(prompts, params, use_tqdm, priority, lora_request)

    def _add_and_run(self, prompts: Iterable, params: list, use_tqdm: bool, priority: list[int] | None,
                     lora_request: Any = None, finished: dict[str, Any] | None = None) -> list:
        """Add one request per prompt (aborting those added if one is refused), run them to the end.
        ``params`` has one entry per prompt; ``prompts`` may be produced as they are added, and the
        producer may step the engine meanwhile, keeping the finished outputs in ``finished``."""
        loras = _loras_per_prompt(lora_request, len(params))
        if priority is not None and len(priority) != len(params):
            raise ValueError(f"priority must have one entry per prompt ({len(params)}), got {len(priority)}")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                if isinstance(p, SamplingParams):
                    p = p.clone()
                    p.output_kind = RequestOutputKind.FINAL_ONLY
                rid = f"offline-{next(self._counter)}"
                self.llm_engine.add_request(rid, prompt, p, lora_request=loras[i],
                                            priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(ids)
            while self.llm_engine.has_unfinished_requests():
                self.llm_engine.step()
            raise
        return self._run(ids, use_tqdm, finished)

    def _run(self, ids: list[str], use_tqdm: bool, finished: dict[str, Any] | None = None) -> list:
        """Step until every request is done; ``finished``: outputs of those that finished earlier."""
        results: dict[str, Any] = dict(finished or {})
        bar = tqdm(total=len(ids), initial=len(results), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        out_tokens = 0
        try:
            while self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if isinstance(out, RequestOutput):
                            out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        if use_tqdm:  # a disabled bar still formats its postfix
                            bar.update(1)
                            bar.set_postfix(output_toks=out_tokens, refresh=False)
        finally:
            bar.close()
        return [results[r] for r in ids]

    def encode(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True, priority: list[int] | None = None) -> list[PoolingRequestOutput]:
        """Pool one prompt or a list with a pooling model (``runner="pooling"``); outputs in input order,
        ``.outputs.data`` the vector (a float32 CPU tensor)."""
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(pooling_params, len(prompts), PoolingParams, "pooling_params")
        finished: dict[str, Any] = {}
        return self._add_and_run(self._pretokenized(prompts, finished), params, use_tqdm, priority,
                                 finished=finished)

    def _pretokenized(self, prompts: list, finished: dict[str, Any]) -> Iterator:
        """The prompts, text ones as token-id prompts, tokenized in batched calls on a background
        thread (a fast tokenizer releases the GIL and splits a batch over its own threads) in
        chunks of ``_TOKENIZE_CHUNK`` texts, ahead of the caller. While a chunk is not ready yet the
        engine steps the requests already added (their finished outputs go to ``finished``), so
        tokenization and the engine's work overlap. An embedding run is mostly short prompts, where
        tokenizing them one by one would cost as much as computing them. Every text is tokenized
        there (none by ``add_request`` meanwhile, on the same tokenizer); empty ones stay text, so
        that ``add_request`` refuses them by name."""
        tokenizer = self.llm_engine.tokenizer
        texts = [t for t in map(_prompt_text, prompts) if t]
        if tokenizer is None or len(texts) < 2:
            yield from prompts
            return
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-tokenize")
        try:
            chunks = [pool.submit(batch_token_ids, tokenizer, texts[i : i + _TOKENIZE_CHUNK])
                      for i in range(0, len(texts), _TOKENIZE_CHUNK)]
            ids = itertools.chain.from_iterable(self._step_until_done(chunk, finished) for chunk in chunks)
            for p in prompts:
                text = _prompt_text(p)
                yield {"prompt": text, "prompt_token_ids": next(ids)} if text else p
        finally:  # also when the caller stops early (a refused prompt): drop the chunks not started
            pool.shutdown(wait=False, cancel_futures=True)

    def _step_until_done(self, future: Future, finished: dict[str, Any]) -> Any:
        """``future``'s result, stepping the engine while it is not ready and there is work."""
        engine = self.llm_engine
        while not future.done() and engine.has_unfinished_requests():
            finished.update((out.request_id, out) for out in engine.step() if out.finished)
        return future.result()

    def embed(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True, priority: list[int] | None = None) -> list[EmbeddingRequestOutput]:
        """Embed one prompt or a list (vLLM's ``LLM.embed``): ``.outputs.embedding`` is a list of floats."""
        return [EmbeddingRequestOutput.from_base(o) for o in self.encode(prompts, pooling_params, use_tqdm, priority)]

    def beam_search(self, prompts: Any, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search: one BeamSearchOutput per prompt whose ``sequences`` (prompt + generated
        ``tokens``, their decoded ``text``, ``cum_logprob``) are the best ``beam_width`` beams, best
        first. Each step runs every live beam as a one-token request; beams of a prompt share their
        common prefix's KV blocks through the prefix cache."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        engine = self.llm_engine
        if 2 * params.beam_width > engine.config.max_logprobs:
            raise ValueError(f"beam_width must be <= max_logprobs / 2 ({engine.config.max_logprobs // 2}), "
                             f"got {params.beam_width}")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompt_ids = [tokenize_prompt(p, engine.tokenizer)[1] for p in prompts]
        step_params = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature,
                                     detokenize=False)

        def step(beams: list[list[int]]) -> list[dict]:
            outs = self.generate([{"prompt_token_ids": b} for b in beams], step_params, use_tqdm=use_tqdm)
            return [(o.outputs[0].logprobs or [{}])[0] for o in outs]

        decode = engine.tokenizer.decode if engine.tokenizer is not None else None
        return run_beam_search(step, prompt_ids, params, engine.eos_token_id, engine.model_config.max_model_len, decode)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Apply the chat template to each conversation and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": apply_chat_template(self.get_tokenizer(), conv, chat_template,
                                                     add_generation_prompt, continue_final_message)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _as_prompt_list(prompts: Any) -> list:
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _prompt_text(prompt: Any) -> str | None:
    """The text of a prompt given as text only (a str, or a dict with just ``"prompt"``), else None."""
    if isinstance(prompt, dict) and prompt.keys() == {"prompt"}:
        prompt = prompt["prompt"]
    return prompt if isinstance(prompt, str) else None


def _per_prompt(params: Any, n: int, kind: type, name: str) -> list:
    """One ``kind`` params object per prompt (``kind()`` when None)."""
    if params is None:
        return [kind()] * n
    if isinstance(params, kind):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{name} must be one {kind.__name__} or one per prompt ({n}), got {len(params)}")
    return params


def _loras_per_prompt(lora_request: Any, n: int) -> list:
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != n:
            raise ValueError(f"lora_request must be one LoRARequest or one per prompt ({n}), got {len(lora_request)}")
        return list(lora_request)
    return [lora_request] * n
