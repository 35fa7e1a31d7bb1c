"""What the completion and chat handlers share: the serving context (engine, tokenizer, names,
limits), body parsing, admission control, logprob formatting, SSE framing and disconnect handling.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.entrypoints.chat_utils import apply_chat_template
from pagedllm.entrypoints.openai import request_body
from pagedllm.entrypoints.openai.errors import OpenAIError, error_body, from_validation_errors
from pagedllm.entrypoints.openai.request_body import default_max_body_bytes
from pagedllm.entrypoints.openai.serving_lora import LoRAModules
from pagedllm.entrypoints.openai.tokenizer_pool import TokenizerPool
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import QUEUE_TIMEOUT_REASON, Logprob, RequestOutput
from pagedllm.tracing import extract_trace_headers, log_tracing_disabled_warning

logger = logging.getLogger("pagedllm.server")

T = TypeVar("T")

# vLLM's stand-in for -inf, which JSON cannot carry.
_MIN_LOGPROB = -9999.0


class ServingContext:
    """Everything a handler needs; one per server.

    ``tokenizer`` is the calling thread's own copy (see ``TokenizerPool``): the event loop may use
    it for short work (decoding a token); long work goes through ``off_loop``/``encode``.
    """

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str] | None = None,
                 chat_template: str | None = None, max_waiting_requests: int | None = None,
                 max_request_body_bytes: int | None = None) -> None:
        self.engine = engine
        self.model_config = engine.get_model_config()
        names = served_model_names or [self.model_config.served_model_name]
        self.served_model_names = [n for n in names if n]
        self.max_model_len = self.model_config.max_model_len
        engine_config = engine.get_engine_config()
        self.max_logprobs = engine_config.max_logprobs
        self.max_num_seqs = engine_config.scheduler_config.max_num_seqs
        # Running slots of the whole server: each data-parallel engine core runs max_num_seqs.
        self.max_running_seqs = self.max_num_seqs * engine_config.parallel_config.data_parallel_size
        self.chat_template = chat_template
        self.max_waiting_requests = max_waiting_requests
        if max_request_body_bytes is not None and max_request_body_bytes < 0:
            raise ValueError(f"max_request_body_bytes must be >= 0 (0: no limit), got {max_request_body_bytes}")
        self.max_request_body_bytes = (default_max_body_bytes(self.max_model_len) if max_request_body_bytes is None
                                       else max_request_body_bytes or None)  # 0: no limit
        self.tokenizers = TokenizerPool(engine.get_tokenizer())
        _ = self.tokenizer  # this thread's copy (uvicorn's event loop runs here), made before serving
        self._compile_chat_template()
        per_token = self.tokenizers.max_chars_per_token
        # A text longer than this cannot fit in max_model_len tokens (None: length proves nothing).
        self.max_prompt_chars = None if per_token is None else self.max_model_len * per_token
        self.created = int(time.time())
        lora_config = engine_config.lora_config
        # The LoRA adapters served by name (--lora-modules, /v1/load_lora_adapter).
        self.loras = LoRAModules(lora_config.max_lora_rank if lora_config is not None else None,
                                 self.model_config.hf_config, self.model_name, self.served_model_names)
        # Set (on the event loop) when --shutdown-timeout has passed after SIGTERM: every in-flight
        # request then ends with a 503 (a stream: an error event and [DONE]).
        self.shutdown_deadline = asyncio.Event()

    def abort_in_flight(self) -> None:
        """Call on the event loop: in-flight requests stop now with a 503 "shutting down"."""
        self.shutdown_deadline.set()

    def _compile_chat_template(self) -> None:
        """Render a one-message chat once, now: compiling a Jinja template takes ~0.1 s holding the
        GIL (transformers caches the result process-wide), too long to happen beside live requests."""
        try:
            apply_chat_template(self.tokenizer, [{"role": "user", "content": "hi"}], self.chat_template)
        except Exception:  # no template, or one that needs more: the first real request will say why
            pass

    @property
    def tokenizer(self):
        return self.tokenizers.tokenizer

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer work (encoding, chat-template rendering) on a tokenizer thread."""
        return await self.tokenizers.run(fn, *args)

    async def encode(self, text: str, add_special_tokens: bool, param: str, truncating: bool = False) -> list[int]:
        """Token ids of ``text``, computed off the event loop. A text whose length alone proves it
        longer than the context is refused without tokenizing it (unless it will be truncated)."""
        if not truncating and self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise OpenAIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"{param} has {len(text)} characters, more than {self.max_model_len} tokens can hold "
                f"(at most {self.tokenizers.max_chars_per_token} characters each). Please reduce the length "
                "of the input.", param=param, code="context_length_exceeded")
        return await self.off_loop(lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> str:
        """The name to report; 404 for a model this server does not serve (neither the base model
        nor one of its LoRA adapters)."""
        if model is None or model == "" or model in self.served_model_names or model in self.loras:
            return self.model_name if not model else model
        served = [*self.served_model_names, *self.loras.adapters]
        raise OpenAIError(404, f"The model `{model}` does not exist. Served: {', '.join(served)}",
                          param="model", code="model_not_found")

    def lora_request(self, model: str, use_beam_search: bool = False) -> LoRARequest | None:
        """The adapter a request's (checked) ``model`` names, or None: the base model. Beam search
        runs the base model only: with an adapter it is a 400."""
        lora = self.loras.get(model)
        if lora is not None and use_beam_search:
            raise OpenAIError(400, f"use_beam_search is not supported with a LoRA adapter (model `{model}`)",
                              param="use_beam_search")
        return lora

    def check_capacity(self, num_new: int = 1, param: str = "prompt") -> None:
        """Admission control for ``num_new`` new sequences (prompts times ``n``).

        Only sequences that would truly wait count against ``--max-waiting-requests``: those beyond
        the running slots that are free now (``max_num_seqs`` minus running), which the scheduler
        fills at its next step. More than that: 503 with Retry-After. A request that could not be
        admitted even by an idle server (more than ``max_num_seqs`` + the limit) is a 400: retrying
        it would never help.
        """
        if not self.engine.is_running:
            raise OpenAIError(503, "the engine is not running (shutting down or failed)", code="engine_unavailable",
                              headers={"Retry-After": "5"})
        limit = self.max_waiting_requests
        if limit is None:
            return
        if num_new > self.max_running_seqs + limit:
            raise OpenAIError(400, f"{param}: this request needs {num_new} sequences (prompts times n), more than "
                              f"the server can ever hold at once ({self.max_running_seqs} running + {limit} waiting)",
                              param=param)
        free_slots = max(0, self.max_running_seqs - self.engine.num_running_requests())
        would_wait = self.engine.num_waiting_requests() + num_new - free_slots
        if would_wait > limit:
            raise OpenAIError(503, f"server overloaded: {would_wait} sequences would wait for a running slot, more "
                              f"than the limit of {limit}; retry later", code="overloaded", headers={"Retry-After": "1"})

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


async def parse_body(request: Request, model_cls: type[BaseModel], max_bytes: int | None = None) -> Any:
    """Read (at most ``max_bytes``), parse and validate a JSON body; every failure is a 4xx."""
    data = request_body.loads(await request_body.read_body(request, max_bytes))
    if not isinstance(data, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    request_body.check_values(data)
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
    if isinstance(err, EngineDeadError):
        return sse(error_body(503, str(err), code="engine_unavailable"))
    return sse(error_body(500, f"{type(err).__name__}: {err}"))


def _shutting_down_error() -> OpenAIError:
    return OpenAIError(503, "the server is shutting down: the request was aborted after --shutdown-timeout",
                       code="server_shutting_down", headers={"Retry-After": "5"})


def _shutdown_deadline(scope) -> asyncio.Event | None:
    app = scope.get("app")
    ctx = getattr(getattr(app, "state", None), "ctx", None)
    return ctx.shutdown_deadline if isinstance(ctx, ServingContext) else None


class EventStreamResponse(StreamingResponse):
    """SSE that watches for the client's disconnect whatever the server's ASGI version: when the
    client goes, the body iterator is cancelled, which aborts the engine request(s) behind it.
    When the shutdown deadline passes first, the iterator is cancelled the same way and the client
    gets an error event and ``[DONE]``."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        deadline = _shutdown_deadline(scope)
        cut_by_shutdown = False
        async with anyio.create_task_group() as tg:

            async def stream_then_stop() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client went away mid-write
                tg.cancel_scope.cancel()

            async def stop_at_deadline() -> None:
                nonlocal cut_by_shutdown
                await deadline.wait()
                cut_by_shutdown = True
                tg.cancel_scope.cancel()

            tg.start_soon(stream_then_stop)
            if deadline is not None:
                tg.start_soon(stop_at_deadline)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()
        if cut_by_shutdown:
            tail = sse_error(_shutting_down_error()) + SSE_DONE
            try:
                await send({"type": "http.response.body", "body": tail.encode(), "more_body": False})
            except OSError:
                pass


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run a handler; if the client disconnects first, cancel it (its requests are aborted); if
    the shutdown deadline passes first, cancel it and answer 503."""
    task = asyncio.ensure_future(work)
    watchers = [asyncio.ensure_future(_wait_disconnect(request))]
    deadline = _shutdown_deadline(request.scope)
    if deadline is not None:
        watchers.append(asyncio.ensure_future(deadline.wait()))
    try:
        await asyncio.wait({task, *watchers}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        for w in watchers:
            w.cancel()
    if task.cancelled() or not task.done():
        if deadline is not None and deadline.is_set():
            return _shutting_down_error().response()
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
