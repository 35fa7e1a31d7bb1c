"""The OpenAI-compatible HTTP server: ``pagedllm serve [MODEL]``.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both stream and non-stream) for a
generation model, POST /v1/embeddings for a pooling model (``serving_embedding.py``), GET /v1/models, POST /tokenize, POST /detokenize, GET /health, GET /version, GET /metrics; with
LoRA (--enable-lora --lora-modules name=path ...) each adapter is a model of its own, chosen by a
request's ``model``, and with PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING POST /v1/load_lora_adapter and
/v1/unload_lora_adapter add and remove adapters (``serving_lora.py``).
Every error is OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``): 400 for a bad
body (naming the field), 401 for a wrong API key (/v1/* and /metrics), 404 for an unknown model,
413 for a body over --max-request-body-bytes, 503 with Retry-After when more than
--max-waiting-requests would wait beyond the free running slots. Tokenization and chat templates
run on tokenizer threads (``tokenizer_pool.py``), so one large prompt never holds /health or the
running streams. A client that disconnects has its engine request aborted before the next engine
step. SIGTERM/SIGINT: stop accepting, let in-flight requests finish for up to --shutdown-timeout
seconds, then answer the rest with a 503 (a stream: an error event and ``[DONE]``), exit 0. The
port is bound before the model loads, so a busy port is reported at once. With
--engine-process the engine runs in a child process; if the engine dies, in-flight requests get an
error, /health answers 503 and the server stops with exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm import envs
from pagedllm.cpu_threads import configure_torch_threads
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.entrypoints.openai.errors import OpenAIError, error_body, error_response, from_validation_errors
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat, render_chat
from pagedllm.entrypoints.openai.serving_common import ServingContext, cancel_on_disconnect, parse_body
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import add_embedding_route
from pagedllm.entrypoints.openai.serving_lora import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    parse_lora_module,
)
from pagedllm.entrypoints.openai.serving_tools import ToolConfig
from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager, validate_tools
from pagedllm.version import __version__

logger = logging.getLogger("pagedllm.server")

_UNPROTECTED_PATHS = ("/health",)  # load balancers probe it without a key


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Server-only flags (the engine's flags are added by the CLI), named as vLLM's."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="address to bind (default: all interfaces)")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on; checked before the model loads")
    g.add_argument("--api-key", default=envs.PAGEDLLM_API_KEY,
                   help="require 'Authorization: Bearer KEY' on every route but /health (env PAGEDLLM_API_KEY)")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one (default: the tokenizer's)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="sequences allowed to wait beyond the free running slots (--max-num-seqs); beyond "
                   "it: 503 with Retry-After; a request that could never fit: 400")
    g.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="largest request body accepted (413 beyond it); 0: no limit "
                   "(default: 4 MiB + 64 bytes per token of --max-model-len)")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM/SIGINT, seconds in-flight requests may finish; then they get a 503 "
                   "(streams: an error event and [DONE])")
    g.add_argument("--stats-log-interval", type=float, default=10.0,
                   help="seconds between throughput log lines (0 turns them off)")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(ToolParserManager.tool_parsers),
                   help="how tool_choice 'auto' reads tool calls out of the model's text (default: picked from "
                   "the chat template's tool-call markers, hermes when it has none)")
    g.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
                   help="serve tool_choice 'auto' (vLLM needs this flag; here it is on unless "
                   "--no-enable-auto-tool-choice, which makes 'auto' a 400)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served by name (with --enable-lora): name=path, or vLLM's JSON "
                   "{\"name\": ..., \"path\": ..., \"base_model_name\": ...}")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False,
                   help="run the engine (scheduling, model, detokenization) in a child process, so that it "
                   "shares no GIL with HTTP and SSE; if it dies, the server stops")


def load_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")
    return value


class APIKeyMiddleware:
    """Pure ASGI (streams pass through untouched): 401 on every path but ``/health`` (the docs and
    the OpenAPI schema included) without ``Authorization: Bearer <key>``; the scheme's case does not
    matter (RFC 9110), the key's does."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    def _authorized(self, header: bytes) -> bool:
        scheme, _, key = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.expected)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"] not in _UNPROTECTED_PATHS:
            if not self._authorized(dict(scope["headers"]).get(b"authorization", b"")):
                resp = error_response(401, "Invalid or missing API key (send 'Authorization: Bearer <key>')",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLMEngine, served_model_names: list[str] | None = None, chat_template: str | None = None,
              api_key: str | None = None, max_waiting_requests: int | None = 1024,
              shutdown_engine: bool = True, max_request_body_bytes: int | None = None,
              tool_config: ToolConfig | None = None, lora_modules: list[str] | None = None) -> FastAPI:
    """The FastAPI app around a running AsyncLLMEngine. ``lora_modules``: ``--lora-modules`` values
    (ValueError naming the flag for a bad one or an adapter folder the engine would refuse)."""
    ctx = ServingContext(engine, served_model_names, chat_template, max_waiting_requests, max_request_body_bytes)
    for value in lora_modules or ():
        ctx.loras.add(*parse_lora_module(value), field="--lora-modules")
    completions = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx, tool_config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        ctx.tokenizers.shutdown()
        if shutdown_engine:
            logger.info("shutting down the engine")
            engine.shutdown()

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    _add_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    if ctx.model_config.runner == "pooling":  # an embedding model serves /v1/embeddings only (404 elsewhere)
        add_embedding_route(app, ctx)
    else:
        _add_generation_routes(app, ctx, completions, chat)

    def model_card(name: str) -> dict:
        lora = ctx.loras.get(name)
        if lora is not None:  # vLLM's card of an adapter: its folder as root, the base model as parent
            return {"id": name, "object": "model", "created": ctx.created, "owned_by": "pagedllm",
                    "root": lora.lora_path, "parent": lora.base_model_name, "max_model_len": ctx.max_model_len}
        return {"id": name, "object": "model", "created": ctx.created, "owned_by": "pagedllm",
                "root": str(ctx.model_config.model), "parent": None, "max_model_len": ctx.max_model_len}

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        names = [*ctx.served_model_names, *ctx.loras.adapters]
        return JSONResponse({"object": "list", "data": [model_card(name) for name in names]})

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> JSONResponse:
        """The ``openai`` client's ``models.retrieve``: one model card, or a 404 naming the id."""
        if model_id not in ctx.served_model_names and model_id not in ctx.loras:
            return error_response(404, f"The model {model_id!r} does not exist.", code="model_not_found",
                                  param="model")
        return JSONResponse(model_card(model_id))

    if envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING:
        _add_lora_routes(app, ctx)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await parse_body(request, TokenizeRequest, ctx.max_request_body_bytes)
        ctx.check_model(body.model)
        if body.messages is not None:
            try:
                tools = validate_tools(body.tools)
            except ValueError as e:
                raise OpenAIError(400, str(e), param="tools") from e
            ids = await ctx.off_loop(render_chat, ctx, body.messages, body.chat_template,
                                     body.add_generation_prompt, body.continue_final_message, tools,
                                     body.chat_template_kwargs)
        elif body.prompt is not None:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await ctx.encode(body.prompt, add_special, "prompt", truncating=True)  # counts any length
        else:
            raise OpenAIError(400, "prompt or messages is required", param="prompt")
        out: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = ctx.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await parse_body(request, DetokenizeRequest, ctx.max_request_body_bytes)
        ctx.check_model(body.model)
        ctx.check_token_ids(body.tokens, "tokens")
        text = await ctx.off_loop(lambda: ctx.tokenizer.decode(body.tokens))
        return JSONResponse({"prompt": text})

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return Response(status_code=200)
        return error_response(503, "engine is not running", code="engine_unavailable")

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _add_lora_routes(app: FastAPI, ctx: ServingContext) -> None:
    """vLLM's runtime adapter endpoints (behind --api-key like every /v1 route); plain-text success."""
    logger.warning("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING is on: clients may load LoRA adapters from server paths")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = await parse_body(request, LoadLoRAAdapterRequest, ctx.max_request_body_bytes)
        return Response(ctx.loras.load(body), media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = await parse_body(request, UnloadLoRAAdapterRequest, ctx.max_request_body_bytes)
        return Response(ctx.loras.unload(body), media_type="text/plain")


def _add_generation_routes(app: FastAPI, ctx: ServingContext, completions: OpenAIServingCompletion,
                           chat: OpenAIServingChat) -> None:
    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, ctx.max_request_body_bytes)
        return await cancel_on_disconnect(request, completions.create(body, ctx.trace_headers(request.headers)))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest, ctx.max_request_body_bytes)
        return await cancel_on_disconnect(request, chat.create(body, ctx.trace_headers(request.headers)))


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), code="engine_unavailable", headers={"Retry-After": "5"})

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_errors(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal server error: {type(exc).__name__}: {exc}"), status_code=500)


def run_server(ns: argparse.Namespace) -> int:
    """``pagedllm serve``: bind the port, load the model, serve until SIGTERM/SIGINT, exit 0."""
    from pagedllm.entrypoints.cli_args import engine_args_from

    chat_template = load_chat_template(ns.chat_template)
    tool_config = ToolConfig(ns.tool_call_parser, ns.enable_auto_tool_choice)
    for flag in ("max_request_body_bytes", "max_waiting_requests"):
        value = getattr(ns, flag)
        if value is not None and value < 0:
            raise SystemExit(f"pagedllm serve: --{flag.replace('_', '-')} must be >= 0, got {value}")
    sock = bind_socket(ns.host, ns.port)  # a busy port is an error now, not after the model loaded
    threads = configure_torch_threads(for_server=True)
    t0 = time.perf_counter()
    interval = ns.stats_log_interval if ns.stats_log_interval and ns.stats_log_interval > 0 else None
    engine = AsyncLLMEngine.from_engine_args(engine_args_from(ns), "OPENAI_API_SERVER", engine_process=ns.engine_process,
                                             log_stats=interval is not None and not ns.disable_log_stats,
                                             log_interval_s=interval or 10.0)
    try:
        app = build_app(engine, chat_template=chat_template, api_key=ns.api_key,
                        max_waiting_requests=ns.max_waiting_requests, max_request_body_bytes=ns.max_request_body_bytes,
                        tool_config=tool_config, lora_modules=ns.lora_modules)
    except ValueError as e:
        engine.shutdown()
        raise SystemExit(f"pagedllm serve: {e}") from None
    logger.info("model %s loaded in %.1f s (%d CPU threads); serving on http://%s:%d",
                engine.get_model_config().served_model_name, time.perf_counter() - t0, threads, ns.host, ns.port)
    shutdown_timeout = max(0.1, ns.shutdown_timeout)
    # uvicorn cancels the handlers still running _SHUTDOWN_GRACE_S after our deadline; by then they
    # have answered (503 / error event and [DONE]) and ended.
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                            access_log=not ns.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=shutdown_timeout + _SHUTDOWN_GRACE_S, timeout_keep_alive=5)
    server = _Server(config, shutdown_timeout, app.state.ctx.abort_in_flight)
    threading.Thread(target=_stop_when_engine_dies, args=(engine, server), name="pagedllm-engine-watch",
                     daemon=True).start()
    # uvicorn re-raises the signal it handled once it has shut down gracefully; make that a no-op
    # so that a SIGTERM/SIGINT stop ends with exit status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    return 0 if server.started and not engine.errored else 1


_SHUTDOWN_GRACE_S = 5.0


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything slow happens; SystemExit (status 1, one clear
    line, no traceback) when the address is taken or not ours to bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: rebinding after a restart
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"pagedllm serve: cannot listen on {host}:{port}: {e.strerror or e} "
                         "(another server there? choose another --port)") from None
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, plus: ``shutdown_timeout`` seconds into a graceful shutdown, call
    ``on_deadline`` (on the event loop) so that in-flight requests are answered with a 503."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float, on_deadline: Callable[[], None]) -> None:
        super().__init__(config)
        self._shutdown_timeout = shutdown_timeout
        self._on_deadline = on_deadline

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        handle = asyncio.get_running_loop().call_later(self._shutdown_timeout, self._on_deadline)
        try:
            await super().shutdown(sockets)
        finally:
            handle.cancel()


def _stop_when_engine_dies(engine: AsyncLLMEngine, server: Any, poll_s: float = 0.5) -> None:
    """A dead engine cannot come back: stop the server (exit status 1) rather than answer 503 forever."""
    while not server.should_exit:
        if engine.errored:
            logger.critical("the engine died; stopping the server")
            server.should_exit = True
            return
        time.sleep(poll_s)
