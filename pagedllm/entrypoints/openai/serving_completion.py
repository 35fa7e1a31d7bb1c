"""POST /v1/completions: one engine request per prompt, choices indexed prompt * n + i.

With ``use_beam_search`` each prompt is searched by ``engine/async_beam_search.py`` instead and
its ``n`` beams, best first, become its choices (streamed as one chunk per beam at the end, as
vLLM; ``beam_search_outputs`` serves the chat handler too). Undeclared fields are judged by the
field table: refused -> 400 naming the field, others listed in the ``x-ignored-fields`` header.
``prompt_logprobs`` come back on each choice, as vLLM.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.responses import JSONResponse, Response

from pagedllm.beam_search import BeamSearchParams, BeamSearchSequence
from pagedllm.engine.async_beam_search import beam_search
from pagedllm.engine.async_engine import RequestStream
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.field_status import COMPLETIONS, fields_of, ignored_fields_header
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.serving_common import (
    SSE_DONE,
    EventStreamResponse,
    ServingContext,
    completion_logprobs,
    merge_streams,
    random_id,
    sse,
    sse_error,
    usage,
)
from pagedllm.entrypoints.openai.structured_outputs import rename_constraint_error
from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput

_FIELDS = set(CompletionRequest.model_fields) | set(fields_of(COMPLETIONS))
_MIN_LOGPROB = -9999.0  # vLLM's stand-in for -inf, which JSON cannot carry


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]


@dataclass
class _ChoiceState:
    """Streaming bookkeeping of one choice."""

    text_len: int = 0
    num_tokens: int = 0
    started: bool = False
    finished: bool = False


@dataclass
class _StreamState:
    choices: dict[int, _ChoiceState] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    counted_prompts: set[int] = field(default_factory=set)

    def choice(self, index: int) -> _ChoiceState:
        st = self.choices.get(index)
        if st is None:
            st = self.choices[index] = _ChoiceState()
        return st

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices.values())


class OpenAIServingCompletion:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, req: CompletionRequest, trace_headers: dict[str, str] | None = None) -> Response:
        ctx = self.ctx
        model = ctx.check_model(req.model)
        lora_request = ctx.lora_request(model, bool(req.use_beam_search))
        max_num_seqs = ctx.engine.get_engine_config().scheduler_config.max_num_seqs
        try:
            ignored = req.check_fields()
            if req.use_beam_search:
                beam_params = req.to_beam_search_params(ctx.max_logprobs, max_num_seqs, req.max_tokens or 1)
            else:
                params = req.to_sampling_params(ctx.max_logprobs, max_num_seqs)
        except (ValueError, TypeError) as e:
            raise bad_request(e, _FIELDS) from e
        prompts = await self._prompts(req)
        for p in prompts:
            ctx.check_length(len(p.token_ids), req.max_tokens, "max_tokens" in req.model_fields_set, "prompt")
        ctx.check_capacity(len(prompts) * req.n, "prompt" if len(prompts) > 1 else "n")
        request_id = req.request_id or random_id("cmpl")
        if req.use_beam_search:
            sources = [beam_search_outputs(ctx, req, f"{request_id}-{i}", p.token_ids, p.text, beam_params,
                                           req.max_tokens) for i, p in enumerate(prompts)]
            streams: list[RequestStream] = []
        else:
            streams = await self._submit(request_id, prompts, params, req, trace_headers, lora_request)
            sources = [ctx.engine.stream_outputs(s) for s in streams]
        created = int(time.time())
        if req.stream:
            response: Response = EventStreamResponse(
                self._stream(req, request_id, created, model, prompts, sources, streams))
        else:
            response = await self._full(req, request_id, created, model, prompts, sources, streams)
        if ignored:
            response.headers["x-ignored-fields"] = ignored_fields_header(ignored)
        return response

    async def _prompts(self, req: CompletionRequest) -> list[_Prompt]:
        p = req.prompt
        if isinstance(p, str):
            items: list = [p]
        elif p and isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        out = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise OpenAIError(400, "prompt must not be an empty string", param="prompt")
                ids = await self.ctx.encode(item, req.add_special_tokens, "prompt",
                                            truncating=req.truncate_prompt_tokens is not None)
                prompt = _Prompt(item, ids)
            else:
                if not item:
                    raise OpenAIError(400, "prompt must not be an empty token list", param="prompt")
                self.ctx.check_token_ids(item, "prompt")
                prompt = _Prompt(None, list(item))
            if req.truncate_prompt_tokens is not None:
                prompt.token_ids = prompt.token_ids[-req.truncate_prompt_tokens:]
            out.append(prompt)
        return out

    async def _submit(self, request_id: str, prompts: list[_Prompt], params, req: CompletionRequest,
                      trace_headers: dict[str, str] | None = None, lora_request=None) -> list[RequestStream]:
        """Queue every prompt at once, then wait for all to be accepted (or abort all on a refusal)."""
        engine = self.ctx.engine
        priority = req.priority
        streams: list[RequestStream] = []
        for i, p in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            prompt = {"prompt_token_ids": p.token_ids}
            if p.text is not None:
                prompt["prompt"] = p.text
            streams.append(engine.submit(rid, prompt, params if i == 0 else params.clone(), priority=priority,
                                         lora_request=lora_request, trace_headers=trace_headers))
        try:
            await engine.wait_all_accepted(streams)
        except (ValueError, TypeError) as e:  # e.g. a schema, regex or grammar that does not parse
            e = rename_constraint_error(e, req.constraint())
            raise bad_request(e, _FIELDS, default_param="prompt") from e
        return streams

    def _prompt_text(self, p: _Prompt) -> str:
        return p.text if p.text is not None else self.ctx.tokenizer.decode(p.token_ids)

    # -- non-streaming ----------------------------------------------------------------------------
    async def _full(self, req: CompletionRequest, request_id: str, created: int, model: str,
                    prompts: list[_Prompt], sources: list[AsyncIterator[RequestOutput]],
                    streams: list[RequestStream]) -> Response:
        engine = self.ctx.engine
        finals: list[RequestOutput | None] = [None] * len(sources)
        try:
            async for i, out in merge_streams(sources):
                finals[i] = out
        finally:
            for s in streams:  # a no-op for finished requests
                engine.abort_stream(s)
        choices = []
        prompt_tokens = completion_tokens = cached = 0
        for i, out in enumerate(finals):
            assert out is not None
            self.ctx.check_timed_out(out)
            prompt_logprobs = prompt_logprobs_json(out.prompt_logprobs, self.ctx.tokenizer)
            prompt_tokens += len(out.prompt_token_ids)
            cached += out.num_cached_tokens
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                text, token_ids, lps = c.text, list(c.token_ids), c.logprobs
                prefix = ""
                if req.echo:
                    prefix = self._prompt_text(prompts[i])
                    if req.logprobs is not None and lps is not None:
                        token_ids = list(out.prompt_token_ids) + token_ids
                        lps = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + list(lps)
                logprobs = None
                if req.logprobs is not None and lps is not None:
                    logprobs = completion_logprobs(token_ids, lps, req.logprobs, 0, self.ctx.tokenizer)
                choices.append({"index": i * req.n + c.index, "text": prefix + text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                "prompt_logprobs": prompt_logprobs})
        choices.sort(key=lambda ch: ch["index"])
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached),
            "system_fingerprint": None,
        })

    # -- streaming --------------------------------------------------------------------------------
    async def _stream(self, req: CompletionRequest, request_id: str, created: int, model: str,
                      prompts: list[_Prompt], sources: list[AsyncIterator[RequestOutput]],
                      streams: list[RequestStream]) -> AsyncIterator[str]:
        engine = self.ctx.engine
        state = _StreamState()
        head = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        merged = merge_streams(sources)
        try:
            async for i, out in merged:
                for chunk in self._chunks(req, head, state, i, out, prompts[i]):
                    yield sse(chunk)
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": usage(state.prompt_tokens, state.completion_tokens,
                                                                 state.cached_tokens)})
        except Exception as e:  # after the headers went out, errors travel in the stream
            yield sse_error(e)
        finally:
            await merged.aclose()
            for s in streams:  # a no-op for finished requests; needed if never iterated
                engine.abort_stream(s)
        yield SSE_DONE

    def _chunks(self, req: CompletionRequest, head: dict, state: _StreamState, prompt_index: int,
                out: RequestOutput, prompt: _Prompt):
        self.ctx.check_timed_out(out)
        if prompt_index not in state.counted_prompts:
            state.counted_prompts.add(prompt_index)
            state.prompt_tokens += len(out.prompt_token_ids)
            state.cached_tokens += out.num_cached_tokens
        for c in out.outputs:
            index = prompt_index * req.n + c.index
            st = state.choice(index)
            if st.finished:
                continue
            text, token_ids, lps = c.text, list(c.token_ids), c.logprobs
            if not st.started and req.echo:
                text = self._prompt_text(prompt) + text
                if req.logprobs is not None and lps is not None:
                    token_ids = list(out.prompt_token_ids) + token_ids
                    lps = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + list(lps)
            st.num_tokens += len(c.token_ids)
            if not text and c.finish_reason is None and not (req.logprobs is not None and token_ids):
                continue
            st.started = True
            st.finished = c.finish_reason is not None
            logprobs = None
            if req.logprobs is not None and lps is not None:
                logprobs = completion_logprobs(token_ids, lps, req.logprobs, st.text_len, self.ctx.tokenizer)
            st.text_len += len(text)
            chunk = {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
            if req.include_usage:
                chunk["usage"] = (usage(state.prompt_tokens, state.completion_tokens)
                                  if req.continuous_usage else None)
            yield chunk


async def beam_search_outputs(ctx: ServingContext, req: CompletionRequest | ChatCompletionRequest, request_id: str,
                              prompt_ids: list[int], prompt_text: str | None, params: BeamSearchParams,
                              max_tokens: int | None) -> AsyncIterator[RequestOutput]:
    """One prompt's beam search as a stream of one final output whose choices are the beams, best
    first (``max_tokens`` None: as far as the context allows). Shared with the chat handler."""
    if max_tokens is None:
        params = dataclasses.replace(params, max_tokens=max(1, ctx.max_model_len - len(prompt_ids)))
    try:
        [result] = await beam_search(ctx.engine, [prompt_ids], params, request_id, req.priority)
    except (ValueError, TypeError) as e:
        raise bad_request(e, _FIELDS, default_param="messages" if isinstance(req, ChatCompletionRequest)
                          else "prompt") from e
    choices = [_beam_choice(ctx, i, beam, len(prompt_ids), req) for i, beam in enumerate(result.sequences)]
    yield RequestOutput(request_id, prompt_text, prompt_ids, None, choices, finished=True)


def _beam_choice(ctx: ServingContext, index: int, beam: BeamSearchSequence, prompt_len: int,
                 req: CompletionRequest | ChatCompletionRequest) -> CompletionOutput:
    # The search already dropped the EOS that ended a beam unless include_stop_str_in_output.
    token_ids = beam.tokens[prompt_len:]
    text = ctx.tokenizer.decode(token_ids, skip_special_tokens=req.skip_special_tokens)
    return CompletionOutput(index, text, token_ids, beam.cum_logprob, None, beam.finish_reason)


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None, tokenizer) -> list[dict | None] | None:
    """vLLM's wire form: per prompt position None (the first) or {token id: {logprob, rank,
    decoded_token}} for the prompt's token and the top ``prompt_logprobs`` ones."""
    if prompt_logprobs is None:
        return None
    return [None if position is None else {str(t): _logprob_json(t, lp, tokenizer) for t, lp in position.items()}
            for position in prompt_logprobs]


def _logprob_json(token_id: int, lp: Logprob, tokenizer) -> dict:
    text = lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([token_id])
    return {"logprob": max(lp.logprob, _MIN_LOGPROB), "rank": lp.rank, "decoded_token": text}
