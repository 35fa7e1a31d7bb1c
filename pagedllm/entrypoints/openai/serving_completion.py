"""POST /v1/completions: one engine request per prompt, choices indexed prompt * n + i."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.responses import JSONResponse, Response

from pagedllm.engine.async_engine import RequestStream
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.protocol import CompletionRequest
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
from pagedllm.outputs import RequestOutput

_FIELDS = set(CompletionRequest.model_fields)


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
        try:
            params = req.to_sampling_params(ctx.max_logprobs)
        except (ValueError, TypeError) as e:
            raise bad_request(e, _FIELDS) from e
        prompts = self._prompts(req)
        for p in prompts:
            ctx.check_length(len(p.token_ids), req.max_tokens, "max_tokens" in req.model_fields_set, "prompt")
        ctx.check_capacity(len(prompts))
        request_id = req.request_id or random_id("cmpl")
        streams = await self._submit(request_id, prompts, params, req.priority, trace_headers)
        created = int(time.time())
        if req.stream:
            return EventStreamResponse(self._stream(req, request_id, created, model, prompts, streams))
        return await self._full(req, request_id, created, model, prompts, streams)

    def _prompts(self, req: CompletionRequest) -> list[_Prompt]:
        p = req.prompt
        if isinstance(p, str):
            items: list = [p]
        elif p and isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        tok = self.ctx.tokenizer
        out = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise OpenAIError(400, "prompt must not be an empty string", param="prompt")
                ids = tok.encode(item, add_special_tokens=req.add_special_tokens)
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

    async def _submit(self, request_id: str, prompts: list[_Prompt], params, priority: int,
                      trace_headers: dict[str, str] | None = None) -> list[RequestStream]:
        """Queue every prompt at once, then wait for all to be accepted (or abort all on a refusal)."""
        engine = self.ctx.engine
        streams: list[RequestStream] = []
        for i, p in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            prompt = {"prompt_token_ids": p.token_ids}
            if p.text is not None:
                prompt["prompt"] = p.text
            streams.append(engine.submit(rid, prompt, params if i == 0 else params.clone(), priority=priority,
                                         trace_headers=trace_headers))
        try:
            for s in streams:
                await engine.wait_accepted(s)
        except BaseException as e:
            for s in streams:
                engine.abort_stream(s)
            if isinstance(e, (ValueError, TypeError)):
                raise bad_request(e, _FIELDS, default_param="prompt") from e
            raise
        return streams

    def _prompt_text(self, p: _Prompt) -> str:
        return p.text if p.text is not None else self.ctx.tokenizer.decode(p.token_ids)

    # -- non-streaming ----------------------------------------------------------------------------
    async def _full(self, req: CompletionRequest, request_id: str, created: int, model: str,
                    prompts: list[_Prompt], streams: list[RequestStream]) -> Response:
        engine = self.ctx.engine
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in merge_streams([engine.stream_outputs(s) for s in streams]):
                finals[i] = out
        finally:
            for s in streams:  # a no-op for finished requests
                engine.abort_stream(s)
        choices = []
        prompt_tokens = completion_tokens = cached = 0
        for i, out in enumerate(finals):
            assert out is not None
            self.ctx.check_timed_out(out)
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
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        choices.sort(key=lambda ch: ch["index"])
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached),
            "system_fingerprint": None,
        })

    # -- streaming --------------------------------------------------------------------------------
    async def _stream(self, req: CompletionRequest, request_id: str, created: int, model: str,
                      prompts: list[_Prompt], streams: list[RequestStream]) -> AsyncIterator[str]:
        engine = self.ctx.engine
        state = _StreamState()
        head = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        merged = merge_streams([engine.stream_outputs(s) for s in streams])
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
