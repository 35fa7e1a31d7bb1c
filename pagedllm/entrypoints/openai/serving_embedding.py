"""POST /v1/embeddings (OpenAI's shape), served by a pooling model (``runner="pooling"``).

``input``: a string, a list of strings, a list of token ids or a list of token-id lists (each
one embedding, in order); ``encoding_format``: "float" (lists of floats) or "base64" (each vector's
float32 little-endian bytes, base64-encoded, as OpenAI sends them); ``dimensions``: Matryoshka
truncation (refused by the engine for a model that was not trained for it); ``user``: OpenAI's
end-user label (not used by the engine). vLLM's extras: ``add_special_tokens`` (default true: BERT's
[CLS] / [SEP]), ``normalize`` (default: the model's) and ``priority``. Any other field is a 400
naming it; so are an empty input and a prompt longer than the context.
"""

from __future__ import annotations

import base64
import time
from typing import Literal

import numpy as np
from pydantic import ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.engine.async_engine import RequestStream
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.protocol import Bool, Int, OpenAIBaseModel, Str
from pagedllm.entrypoints.openai.serving_common import (
    ServingContext,
    cancel_on_disconnect,
    merge_streams,
    parse_body,
    random_id,
)
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams


class EmbeddingRequest(OpenAIBaseModel):
    model_config = ConfigDict(extra="forbid")  # nothing accepted and ignored

    input: Str | list[Int] | list[Str] | list[list[Int]]
    model: Str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None
    user: Str | None = None
    add_special_tokens: Bool = True
    normalize: Bool | None = None
    priority: Int = 0


_FIELDS = set(EmbeddingRequest.model_fields)


class OpenAIServingEmbedding:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, req: EmbeddingRequest) -> Response:
        ctx = self.ctx
        model = ctx.check_model(req.model)
        try:
            params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
        except (ValueError, TypeError) as e:
            raise bad_request(e, _FIELDS) from e
        prompts = await self._prompts(req)
        ctx.check_capacity(len(prompts), "input")
        request_id = random_id("embd")
        streams = await self._submit(request_id, prompts, params, req.priority)
        finals: list[PoolingRequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in merge_streams([ctx.engine.stream_outputs(s) for s in streams]):
                finals[i] = out
        finally:
            for s in streams:  # a no-op for finished requests
                ctx.engine.abort_stream(s)
        data = [{"object": "embedding", "index": i, "embedding": _encode(self._vector(out), req.encoding_format)}
                for i, out in enumerate(finals)]
        num_tokens = sum(len(p) for p in prompts)
        return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()), "model": model,
                             "data": data, "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})

    async def _prompts(self, req: EmbeddingRequest) -> list[list[int]]:
        """Token ids of each input; 400 naming ``input`` for an empty one or one beyond the context."""
        x = req.input
        items: list = [x] if isinstance(x, str) or (x and isinstance(x[0], int)) else list(x)
        if not items:
            raise OpenAIError(400, "input must not be empty", param="input")
        prompts = []
        for item in items:
            if not item:
                raise OpenAIError(400, "input must not contain an empty string or token list", param="input")
            if isinstance(item, str):
                ids = await self.ctx.encode(item, req.add_special_tokens, "input")
            else:
                self.ctx.check_token_ids(item, "input")
                ids = list(item)
            if len(ids) > self.ctx.max_model_len:
                raise OpenAIError(400, f"This model's maximum context length is {self.ctx.max_model_len} tokens. "
                                  f"However, your input has {len(ids)} tokens. Please reduce the length of the input.",
                                  param="input", code="context_length_exceeded")
            prompts.append(ids)
        return prompts

    async def _submit(self, request_id: str, prompts: list[list[int]], params: PoolingParams,
                      priority: int) -> list[RequestStream]:
        """Queue every input at once, then wait for all to be accepted (or abort all on a refusal)."""
        engine = self.ctx.engine
        streams = [engine.submit(f"{request_id}-{i}", {"prompt_token_ids": ids}, params, priority=priority)
                   for i, ids in enumerate(prompts)]
        try:
            await engine.wait_all_accepted(streams)
        except (ValueError, TypeError) as e:  # e.g. dimensions the model does not allow
            raise bad_request(e, _FIELDS, default_param="input") from e
        return streams

    def _vector(self, out: PoolingRequestOutput | None) -> np.ndarray:
        if out is None or out.outputs is None:
            raise OpenAIError(503, "the request was aborted before it was computed (it waited longer than the "
                              "server's timeout_s, or the KV cache cannot hold it); retry later",
                              code="request_aborted", headers={"Retry-After": "1"})
        return out.outputs.data.numpy()


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def add_embedding_route(app, ctx: ServingContext) -> None:
    """Register ``POST /v1/embeddings`` on the FastAPI ``app``."""
    serving = OpenAIServingEmbedding(ctx)

    @app.post("/v1/embeddings")
    async def create_embedding(request: Request) -> Response:
        body = await parse_body(request, EmbeddingRequest, ctx.max_request_body_bytes)
        return await cancel_on_disconnect(request, serving.create(body))
