"""What the completion and chat handlers share: the serving context (engine, tokenizer, names,
limits), body parsing, admission control, logprob formatting, SSE framing and disconnect handling.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.errors import OpenAIError, error_body, from_validation_errors
from pagedllm.outputs import QUEUE_TIMEOUT_REASON, Logprob, RequestOutput
from pagedllm.tracing import extract_trace_headers, log_tracing_disabled_warning

logger = logging.getLogger("pagedllm.server")

# vLLM's stand-in for -inf, which JSON cannot carry.
_MIN_LOGPROB = -9999.0


class ServingContext:
    """Everything a handler needs; one per server."""

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str] | None = None,
                 chat_template: str | None = None, max_waiting_requests: int | None = None) -> None:
        self.engine = engine
        self.model_config = engine.get_model_config()
        names = served_model_names or [self.model_config.served_model_name]
        self.served_model_names = [n for n in names if n]
        self.max_model_len = self.model_config.max_model_len
        self.max_logprobs = engine.get_engine_config().max_logprobs
        self.chat_template = chat_template
        self.max_waiting_requests = max_waiting_requests
        self.tokenizer = _private_tokenizer(engine.get_tokenizer())
        self.created = int(time.time())

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> str:
        """The name to report; 404 for a model this server does not serve."""
        if model is None or model == "" or model in self.served_model_names:
            return self.model_name if not model else model
        raise OpenAIError(404, f"The model `{model}` does not exist. Served: {', '.join(self.served_model_names)}",
                          param="model", code="model_not_found")

    def check_capacity(self, num_new: int = 1) -> None:
        """503 with Retry-After when the waiting queue is full (nothing is queued silently forever)."""
        if not self.engine.is_running:
            raise OpenAIError(503, "the engine is not running (shutting down or failed)", code="engine_unavailable",
                              headers={"Retry-After": "5"})
        limit = self.max_waiting_requests
        if limit is None:
            return
        waiting = self.engine.num_waiting_requests()
        if waiting + num_new > limit:
            raise OpenAIError(503, f"server overloaded: {waiting} requests are waiting (limit {limit}); retry later",
                              code="overloaded", headers={"Retry-After": "1"})

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, max_tokens_explicit: bool,
                     prompt_param: str, max_tokens_param: str = "max_tokens") -> None:
        if num_prompt_tokens >= self.max_model_len:
            raise OpenAIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"{prompt_param} has {num_prompt_tokens} tokens (the prompt plus at least one generated token "
                "must fit). Please reduce the length of the input.", param=prompt_param,
                code="context_length_exceeded")
        if max_tokens_explicit and max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len:
            raise OpenAIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {prompt_param}, {max_tokens} "
                f"in the completion). Please reduce the length of the {prompt_param} or {max_tokens_param}.",
                param=max_tokens_param, code="context_length_exceeded")

    def trace_headers(self, headers: Mapping[str, str]) -> dict[str, str] | None:
        """The W3C trace headers of an HTTP request, for the engine's span; None when tracing is
        off (then, as vLLM, a request that carries them only gets a warning, once)."""
        found = extract_trace_headers(headers)
        if not self.engine.is_tracing_enabled():
            if found:
                log_tracing_disabled_warning()
            return None
        return found or None

    def check_timed_out(self, out: RequestOutput) -> None:
        """503 (retry later) for a request the engine finished because it waited in the queue
        longer than ``--timeout-s``; in a stream it becomes an SSE error event before [DONE]."""
        if any(c.finish_reason == "abort" and c.stop_reason == QUEUE_TIMEOUT_REASON for c in out.outputs):
            timeout_s = self.engine.get_engine_config().scheduler_config.timeout_s
            raise OpenAIError(503, f"the request waited in the queue longer than the server's timeout_s "
                              f"({timeout_s} s) without being scheduled; retry later", code="queue_timeout",
                              headers={"Retry-After": "1"})

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if t < 0 or t >= vocab]
        if bad:
            raise OpenAIError(400, f"{param} contains token ids outside the vocabulary (size {vocab}): {bad[:5]}",
                              param=param)


def _private_tokenizer(tokenizer):
    """A copy for the event-loop thread: HF fast tokenizers must not be used by two threads at once."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # pragma: no cover - an unusual tokenizer; share it
        return tokenizer


async def parse_body(request: Request, model_cls: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"malformed JSON in the request body: {e}", code="invalid_json") from e
    if not isinstance(data, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise from_validation_errors(e.errors(include_url=False)) from e


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


# -- logprobs ---------------------------------------------------------------------------------------
def _clamp(x: float) -> float:
    return x if x > _MIN_LOGPROB else _MIN_LOGPROB


def _token_text(token_id: int, lp: Logprob | None, tokenizer) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def _ranked(position: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(position.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30))


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob] | None], num_top: int,
                        text_offset: int, tokenizer) -> dict:
    """The completions format: tokens, token_logprobs, top_logprobs (dicts), text_offset."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, position in zip(token_ids, logprobs):
        if position is None:  # the first prompt token has no logprob
            text = tokenizer.decode([tid])
            out["tokens"].append(text)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            chosen = position.get(tid)
            text = _token_text(tid, chosen, tokenizer)
            out["tokens"].append(text)
            out["token_logprobs"].append(_clamp(chosen.logprob) if chosen else None)
            top: dict[str, float] = {}
            for t, lp in _ranked(position)[:num_top]:
                top[_token_text(t, lp, tokenizer)] = _clamp(lp.logprob)
            if chosen is not None:
                top.setdefault(text, _clamp(chosen.logprob))
            out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int, tokenizer) -> dict:
    """The chat format: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    content = []
    for tid, position in zip(token_ids, logprobs):
        chosen = position.get(tid)
        text = _token_text(tid, chosen, tokenizer)
        top = []
        for t, lp in _ranked(position)[:num_top]:
            s = _token_text(t, lp, tokenizer)
            top.append({"token": s, "logprob": _clamp(lp.logprob), "bytes": list(s.encode("utf-8"))})
        content.append({"token": text, "logprob": _clamp(chosen.logprob) if chosen else _MIN_LOGPROB,
                        "bytes": list(text.encode("utf-8")), "top_logprobs": top})
    return {"content": content}


# -- streaming --------------------------------------------------------------------------------------
def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(err: BaseException) -> str:
    if isinstance(err, OpenAIError):
        return sse(err.body())
    return sse(error_body(500, f"{type(err).__name__}: {err}"))


class EventStreamResponse(StreamingResponse):
    """SSE that watches for the client's disconnect whatever the server's ASGI version: when the
    client goes, the body iterator is cancelled, which aborts the engine request(s) behind it."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:

            async def stream_then_stop() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client went away mid-write
                tg.cancel_scope.cancel()

            tg.start_soon(stream_then_stop)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run a handler; if the client disconnects first, cancel it (its requests are aborted)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled() or not task.done():
        logger.info("client disconnected: request cancelled")
        return Response(status_code=499)
    return task.result()


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators as (index, item); errors propagate; leaving early cancels all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
            await queue.put((i, done))
        except Exception as e:  # handed to the consumer
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
