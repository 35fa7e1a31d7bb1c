"""POST /v1/chat/completions: chat template -> one engine request (n choices) -> message or SSE deltas.

Undeclared fields are judged by the field table: refused -> 400 naming the field, others listed
in the ``x-ignored-fields`` response header. ``prompt_logprobs`` come back at the top of the
response, as vLLM. With ``use_beam_search`` the ``n`` beams, best first, are the choices. Tools:
``serving_tools.py``; output constraints (``response_format``, ``guided_*``): ``structured_outputs.py``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.responses import JSONResponse, Response

from pagedllm.engine.async_engine import RequestStream
from pagedllm.entrypoints.chat_utils import apply_chat_template, check_chat_template_kwargs, text_messages
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.field_status import CHAT, fields_of, ignored_fields_header
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagedllm.entrypoints.openai.serving_common import (
    SSE_DONE,
    EventStreamResponse,
    ServingContext,
    chat_logprobs,
    random_id,
    sse,
    sse_error,
    usage,
)
from pagedllm.entrypoints.openai.serving_completion import beam_search_outputs, prompt_logprobs_json
from pagedllm.entrypoints.openai.serving_tools import (
    ChoiceToolStream,
    ToolConfig,
    ToolPlan,
    finish_reason,
    plan_tools,
    whole_reply,
)
from pagedllm.entrypoints.openai.structured_outputs import rename_constraint_error
from pagedllm.outputs import RequestOutput

_FIELDS = set(ChatCompletionRequest.model_fields) | set(fields_of(CHAT))


def render_chat(ctx: ServingContext, messages: list[ChatMessage], chat_template: str | None,
                add_generation_prompt: bool, continue_final_message: bool, tools: list[dict] | None = None,
                chat_template_kwargs: dict | None = None) -> list[int]:
    """Messages (and tools) -> prompt token ids through the chat template; a 400 naming
    ``messages`` (or ``chat_template_kwargs``) on failure."""
    if not messages:
        raise OpenAIError(400, "messages must be a non-empty list", param="messages")
    try:
        dicts = text_messages([m.model_dump(exclude_none=True) for m in messages])
    except ValueError as e:  # the conversation itself: role, content, a non-text part, tool calls
        raise OpenAIError(400, str(e), param="messages") from e
    try:
        extra = check_chat_template_kwargs(chat_template_kwargs)
    except ValueError as e:
        raise OpenAIError(400, str(e), param="chat_template_kwargs") from e
    try:
        return apply_chat_template(ctx.tokenizer, dicts, chat_template or ctx.chat_template,
                                   add_generation_prompt, continue_final_message, tools, extra)
    except OpenAIError:
        raise
    except Exception as e:  # template errors (jinja), no template at all
        raise OpenAIError(400, f"messages could not be rendered with the chat template: {e}", param="messages") from e


class OpenAIServingChat:
    def __init__(self, ctx: ServingContext, tool_config: ToolConfig | None = None) -> None:
        self.ctx = ctx
        self.tool_config = tool_config or ToolConfig()

    async def create(self, req: ChatCompletionRequest, trace_headers: dict[str, str] | None = None) -> Response:
        ctx = self.ctx
        model = ctx.check_model(req.model)
        lora_request = ctx.lora_request(model, bool(req.use_beam_search))
        max_num_seqs = ctx.engine.get_engine_config().scheduler_config.max_num_seqs
        try:
            ignored = req.check_fields()
            if req.use_beam_search:  # refuses tools unless tool_choice is none: they still reach the template
                beam_params = req.to_beam_search_params(ctx.max_logprobs, max_num_seqs, req.requested_max_tokens or 1)
            plan = plan_tools(req, self.tool_config, self._template_source(req))
            if not req.use_beam_search:
                params = req.to_sampling_params(ctx.max_logprobs, max_num_seqs, plan.schema)
        except (ValueError, TypeError) as e:
            raise bad_request(e, _FIELDS) from e
        prompt_ids = await ctx.off_loop(render_chat, ctx, req.messages, req.chat_template,
                                        req.add_generation_prompt, req.continue_final_message, plan.tools,
                                        req.chat_template_kwargs)
        if req.truncate_prompt_tokens is not None:
            prompt_ids = prompt_ids[-req.truncate_prompt_tokens:]
        ctx.check_length(len(prompt_ids), req.requested_max_tokens,
                         req.max_completion_tokens is not None or req.max_tokens is not None,
                         "messages", req.max_tokens_field)
        ctx.check_capacity(req.n, "n")
        request_id = req.request_id or random_id("chatcmpl")
        stream: RequestStream | None = None
        if req.use_beam_search:
            outputs = beam_search_outputs(ctx, req, request_id, prompt_ids, None, beam_params, req.requested_max_tokens)
        else:
            try:
                stream = await ctx.engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, params,
                                                      priority=req.priority, lora_request=lora_request,
                                                      trace_headers=trace_headers)
            except (ValueError, TypeError) as e:  # a schema, regex or grammar that does not parse
                e = rename_constraint_error(e, req.constraint(plan.schema))
                raise bad_request(e, _FIELDS, default_param="messages") from e
            outputs = ctx.engine.stream_outputs(stream)
        created = int(time.time())
        if req.stream:
            response: Response = EventStreamResponse(self._stream(req, plan, request_id, created, model, outputs,
                                                                  stream))
        else:
            response = await self._full(req, plan, request_id, created, model, outputs, stream)
        if ignored:
            response.headers["x-ignored-fields"] = ignored_fields_header(ignored)
        return response

    def _template_source(self, req: ChatCompletionRequest) -> str | None:
        """The chat template this request renders with (its tool-call markers pick the auto parser)."""
        try:
            return self.ctx.tokenizer.get_chat_template(req.chat_template or self.ctx.chat_template, req.tools or None)
        except (ValueError, TypeError):  # no template: rendering will say so, naming messages
            return None

    def _echo_prefix(self, req: ChatCompletionRequest) -> str:
        if req.echo and req.messages and req.messages[-1].role == "assistant":
            content = req.messages[-1].content
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return ""

    def _logprobs(self, req: ChatCompletionRequest, token_ids, lps) -> dict | None:
        if not req.logprobs or lps is None:
            return None
        return chat_logprobs(token_ids, lps, req.top_logprobs or 0, self.ctx.tokenizer)

    async def _full(self, req: ChatCompletionRequest, plan: ToolPlan, request_id: str, created: int, model: str,
                    outputs: AsyncIterator[RequestOutput], stream: RequestStream | None) -> Response:
        final = None
        try:
            async for out in outputs:
                final = out
        finally:
            await outputs.aclose()
            if stream is not None:
                self.ctx.engine.abort_stream(stream)  # a no-op once finished
        assert final is not None
        self.ctx.check_timed_out(final)
        prefix = self._echo_prefix(req)
        choices = []
        for c in final.outputs:
            content, tool_calls = whole_reply(plan, self.ctx.tokenizer, c.text)
            message: dict = {"role": "assistant", "content": prefix + content if content is not None else prefix or None}
            if tool_calls:
                message["tool_calls"] = tool_calls
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": self._logprobs(req, c.token_ids, c.logprobs),
                "finish_reason": finish_reason(c.finish_reason, bool(tool_calls)),
                "stop_reason": c.stop_reason,
            })
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(len(final.prompt_token_ids), completion_tokens,
                                               final.num_cached_tokens),
            "system_fingerprint": None,
            "prompt_logprobs": prompt_logprobs_json(final.prompt_logprobs, self.ctx.tokenizer),
        })

    async def _stream(self, req: ChatCompletionRequest, plan: ToolPlan, request_id: str, created: int, model: str,
                      outputs: AsyncIterator[RequestOutput], stream: RequestStream | None) -> AsyncIterator[str]:
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        include_usage, continuous = req.include_usage, req.continuous_usage
        prompt_tokens = 0
        completion_tokens = 0
        cached = 0
        finished: set[int] = set()
        choices = [ChoiceToolStream(plan, self.ctx.tokenizer) for _ in range(req.n)]

        def chunk(choice: dict) -> str:
            body = {**head, "choices": [choice]}
            if include_usage:
                body["usage"] = usage(prompt_tokens, completion_tokens) if continuous else None
            return sse(body)

        try:
            prefix = self._echo_prefix(req)
            for i in range(req.n):  # the role goes first, in a chunk of its own per choice
                first = prefix or (None if plan.parses_calls else "")  # null when the reply may be only calls
                yield chunk({"index": i, "delta": {"role": "assistant", "content": first},
                             "logprobs": None, "finish_reason": None})
            async for out in outputs:
                self.ctx.check_timed_out(out)
                prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
                for c in out.outputs:
                    if c.index in finished:
                        continue
                    completion_tokens += len(c.token_ids)
                    logprobs = self._logprobs(req, c.token_ids, c.logprobs) if c.token_ids else None
                    state = choices[c.index]
                    delta = state.step(c.text, c.finish_reason is not None)
                    if not delta and c.finish_reason is None and logprobs is None:
                        continue
                    if c.finish_reason is not None:
                        finished.add(c.index)
                    yield chunk({"index": c.index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish_reason(c.finish_reason, state.called_tools),
                                 "stop_reason": c.stop_reason})
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached)})
        except Exception as e:
            yield sse_error(e)
        finally:
            await outputs.aclose()
            if stream is not None:  # a no-op once finished; needed if never iterated
                self.ctx.engine.abort_stream(stream)
        yield SSE_DONE
