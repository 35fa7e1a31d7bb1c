"""The OpenAI-compatible HTTP server: ``pagedllm serve [MODEL]``.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both stream and non-stream),
GET /v1/models, POST /tokenize, POST /detokenize, GET /health, GET /version, GET /metrics.
Every error is OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``): 400 for a bad
body (naming the field), 401 for a wrong API key (/v1/* and /metrics), 404 for an unknown model,
503 with Retry-After when more than --max-waiting-requests wait. A client that disconnects has its
engine request aborted before the next engine step. SIGTERM/SIGINT: stop accepting, let in-flight
requests finish for up to --shutdown-timeout seconds, abort the rest, exit 0. With
--engine-process the engine runs in a child process; if the engine dies, in-flight requests get an
error, /health answers 503 and the server stops with exit status 1.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import signal
import threading
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm import envs
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
from pagedllm.version import __version__

logger = logging.getLogger("pagedllm.server")

_UNPROTECTED_PATHS = ("/health",)  # load balancers probe it without a key


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Server-only flags (the engine's flags are added by the CLI), named as vLLM's."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="address to bind (default: all interfaces)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=envs.PAGEDLLM_API_KEY,
                   help="require 'Authorization: Bearer KEY' on every route but /health (env PAGEDLLM_API_KEY)")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one (default: the tokenizer's)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--disable-uvicorn-access-log", action="store_true")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="requests allowed to wait for a slot; beyond it: 503 with Retry-After")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM/SIGINT, seconds in-flight requests may finish before they are aborted")
    g.add_argument("--stats-log-interval", type=float, default=10.0,
                   help="seconds between throughput log lines (0 turns them off)")
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
              shutdown_engine: bool = True) -> FastAPI:
    """The FastAPI app around a running AsyncLLMEngine."""
    ctx = ServingContext(engine, served_model_names, chat_template, max_waiting_requests)
    completions = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if shutdown_engine:
            logger.info("shutting down the engine")
            engine.shutdown()

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    _add_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        return await cancel_on_disconnect(request, completions.create(body, ctx.trace_headers(request.headers)))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        return await cancel_on_disconnect(request, chat.create(body, ctx.trace_headers(request.headers)))

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": ctx.created, "owned_by": "pagedllm",
                "root": str(ctx.model_config.model), "parent": None, "max_model_len": ctx.max_model_len}

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(name) for name in ctx.served_model_names]})

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> JSONResponse:
        """The ``openai`` client's ``models.retrieve``: one model card, or a 404 naming the id."""
        if model_id not in ctx.served_model_names:
            return error_response(404, f"The model {model_id!r} does not exist.", code="model_not_found",
                                  param="model")
        return JSONResponse(model_card(model_id))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await parse_body(request, TokenizeRequest)
        ctx.check_model(body.model)
        if body.messages is not None:
            ids = render_chat(ctx, body.messages, body.chat_template, body.add_generation_prompt,
                              body.continue_final_message)
        elif body.prompt is not None:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = ctx.tokenizer.encode(body.prompt, add_special_tokens=add_special)
        else:
            raise OpenAIError(400, "prompt or messages is required", param="prompt")
        out: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = ctx.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await parse_body(request, DetokenizeRequest)
        ctx.check_model(body.model)
        ctx.check_token_ids(body.tokens, "tokens")
        return JSONResponse({"prompt": ctx.tokenizer.decode(body.tokens)})

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
    """``pagedllm serve``: load the model, serve until SIGTERM/SIGINT, exit 0."""
    import uvicorn

    from pagedllm.entrypoints.cli_args import engine_args_from

    chat_template = load_chat_template(ns.chat_template)
    t0 = time.perf_counter()
    interval = ns.stats_log_interval if ns.stats_log_interval and ns.stats_log_interval > 0 else None
    engine = AsyncLLMEngine.from_engine_args(engine_args_from(ns), "OPENAI_API_SERVER", engine_process=ns.engine_process,
                                             log_stats=interval is not None and not ns.disable_log_stats,
                                             log_interval_s=interval or 10.0)
    app = build_app(engine, chat_template=chat_template, api_key=ns.api_key,
                    max_waiting_requests=ns.max_waiting_requests)
    logger.info("model %s loaded in %.1f s; serving on http://%s:%d", engine.get_model_config().served_model_name,
                time.perf_counter() - t0, ns.host, ns.port)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                            access_log=not ns.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=max(0.1, ns.shutdown_timeout), timeout_keep_alive=5)
    server = uvicorn.Server(config)
    threading.Thread(target=_stop_when_engine_dies, args=(engine, server), name="pagedllm-engine-watch",
                     daemon=True).start()
    # uvicorn re-raises the signal it handled once it has shut down gracefully; make that a no-op
    # so that a SIGTERM/SIGINT stop ends with exit status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        engine.shutdown()
    return 0 if server.started and not engine.errored else 1


def _stop_when_engine_dies(engine: AsyncLLMEngine, server: Any, poll_s: float = 0.5) -> None:
    """A dead engine cannot come back: stop the server (exit status 1) rather than answer 503 forever."""
    while not server.should_exit:
        if engine.errored:
            logger.critical("the engine died; stopping the server")
            server.should_exit = True
            return
        time.sleep(poll_s)
