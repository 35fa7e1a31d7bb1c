"""The one table of request fields of ``/v1/completions`` and ``/v1/chat/completions``: what the
server does with each (OpenAI's fields and vLLM's extensions).

- ``works``: the field does what OpenAI / vLLM document (the request models declare it).
- ``refused``: a request that sets it gets a 400 naming it (``param`` = the field), with the
  reason; values listed as ``inert`` (null, or the value that asks for nothing) pass.
- ``ignored``: OpenAI fields no client relies on for behaviour (identifiers, billing, retention):
  accepted, logged once per name at warning level and echoed in the ``x-ignored-fields`` header.
  A field in no row is treated the same way.

Turning a feature on is one line here (and the request model declaring the field and passing it
on; a test checks that the two agree). The docs table
(``docs/api-fields.md``) is rendered from ``FIELDS`` by ``scripts/render_performance.py``.
Cost: a dict lookup per top-level field of a request.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("pagedllm.server")

COMPLETIONS = "completions"
CHAT = "chat"
BOTH = (COMPLETIONS, CHAT)


class Status(str, enum.Enum):
    WORKS = "works"
    REFUSED = "refused"
    IGNORED = "ignored"


@dataclass(frozen=True)
class FieldStatus:
    """One row: a request field, where it exists, what happens to it and why.

    ``example`` is a value that exercises the field (the table-driven test posts it); ``inert``
    are the values of a refused field that ask for nothing and therefore pass.
    """

    name: str
    status: Status
    why: str
    example: Any
    endpoints: tuple[str, ...] = BOTH
    origin: str = "OpenAI"
    inert: tuple[Any, ...] = (None,)


W, R, IGN = Status.WORKS, Status.REFUSED, Status.IGNORED  # short names keep the rows on one line
_STRUCTURED_TAGS = "structural tags are not implemented"
_TOOLS = "not implemented"


def _row(name: str, status: Status, why: str, example: Any, endpoints: tuple[str, ...] = BOTH,
         origin: str = "OpenAI", inert: tuple[Any, ...] = (None,)) -> FieldStatus:
    return FieldStatus(name, status, why, example, endpoints, origin, inert)


FIELDS: tuple[FieldStatus, ...] = (
    # -- OpenAI, both endpoints ---------------------------------------------------------------------
    _row("model", W, "must name a served model (404 otherwise); empty = the first", "SmolLM2-135M-Instruct"),
    _row("frequency_penalty", W, "in [-2, 2]", 0.5),
    _row("presence_penalty", W, "in [-2, 2]", 0.5),
    _row("logit_bias", W, "token id -> bias in [-100, 100]", {"42": 1.0}),
    _row("max_tokens", W, "at least 1; prompt + max_tokens must fit the context", 3),
    _row("n", W, "choices per prompt, at most the engine's max_num_seqs; beam width with use_beam_search", 2),
    _row("seed", W, "a seeded request gives the same text alone or in any batch", 7),
    _row("stop", W, "up to any number of strings", ["\n\n"]),
    _row("stream", W, "server-sent events, ended by [DONE]", True),
    _row("stream_options", W, "include_usage, continuous_usage_stats; only with stream=true",
         {"include_usage": True}),
    _row("temperature", W, "a finite number >= 0 (0 = greedy)", 0.7),
    _row("top_p", W, "in (0, 1]", 0.9),
    _row("user", IGN, "an end-user id for OpenAI's abuse monitoring; no behaviour", "user-1"),
    _row("metadata", IGN, "tags for OpenAI's stored completions; nothing is stored", {"k": "v"}),
    _row("store", IGN, "OpenAI's retention of the output; nothing is stored", True),
    _row("service_tier", IGN, "OpenAI's billing / latency tier; one tier here", "auto"),
    _row("prompt_cache_key", IGN, "a cache-routing hint; the prefix cache needs none", "key"),
    _row("safety_identifier", IGN, "an end-user id for OpenAI's abuse monitoring; no behaviour", "id-1"),
    # -- OpenAI, completions ------------------------------------------------------------------------
    _row("prompt", W, "text, token ids, or a list of either (one engine request each)", "Hello",
         (COMPLETIONS,)),
    _row("best_of", W, "must equal n (no server-side reranking)", 1, (COMPLETIONS,)),
    _row("echo", W, "the prompt is prepended to the text (and its logprobs with logprobs)", True, (COMPLETIONS,)),
    _row("logprobs", W, "top logprobs per token, at most --max-logprobs", 2, (COMPLETIONS,)),
    _row("suffix", R, "insertion (fill in the middle) is not implemented", "end", (COMPLETIONS,), inert=(None, "")),
    # -- OpenAI, chat -------------------------------------------------------------------------------
    _row("messages", W, "roles system, developer, user, assistant, tool, function; text parts only",
         [{"role": "user", "content": "Hi"}], (CHAT,)),
    _row("logprobs", W, "true returns each token's logprob", True, (CHAT,)),
    _row("top_logprobs", W, "0..--max-logprobs, with logprobs=true", 0, (CHAT,)),
    _row("max_completion_tokens", W, "like max_tokens; wins over it", 3, (CHAT,)),
    _row("response_format", W, "json_object, or json_schema {name, schema, strict}: the output follows it "
         "(an xgrammar grammar; strict or not); text = free. One output constraint per request",
         {"type": "json_object"}),
    _row("tools", W, "function tools, passed to the chat template (a template that does not render them gets "
         "them in the system prompt, hermes style; see docs/structured-outputs.md)",
         [{"type": "function", "function": {"name": "f"}}], (CHAT,)),
    _row("tool_choice", W, "none, auto (the default with tools: calls parsed from the text), required or a named "
         "function (enforced by a grammar from the tools' parameters); needs tools", "auto", (CHAT,)),
    _row("parallel_tool_calls", W, "false: at most one tool call per choice", False, (CHAT,)),
    _row("functions", R, _TOOLS + " (functions is the deprecated form of tools: send tools)",
         [{"name": "f"}], (CHAT,)),
    _row("function_call", R, _TOOLS + " (the deprecated form of tool_choice; only \"none\" passes)", "auto",
         (CHAT,), inert=(None, "none")),
    _row("modalities", R, "text output only", ["text", "audio"], (CHAT,), inert=(None, ["text"])),
    _row("audio", R, "audio output is not implemented", {"voice": "alloy", "format": "wav"}, (CHAT,)),
    _row("prediction", R, "predicted outputs are not implemented", {"type": "content", "content": "x"}, (CHAT,)),
    _row("reasoning_effort", R, "no served model reasons (OpenAI refuses it for such models too)", "low",
         (CHAT,)),
    _row("verbosity", R, "no served model takes a verbosity hint", "low", (CHAT,)),
    _row("web_search_options", R, "web search is not implemented", {}, (CHAT,)),
    # -- vLLM's extensions, both endpoints ----------------------------------------------------------
    _row("top_k", W, "0 or -1 = off", 5, origin="vLLM"),
    _row("min_p", W, "in [0, 1]", 0.05, origin="vLLM"),
    _row("repetition_penalty", W, "> 0; 1 = off", 1.1, origin="vLLM"),
    _row("ignore_eos", W, "keep generating past EOS", True, origin="vLLM"),
    _row("min_tokens", W, "the choice does not stop (EOS, stop token ids) before this many tokens", 1, origin="vLLM"),
    _row("stop_token_ids", W, "token ids that end a choice", [2], origin="vLLM"),
    _row("skip_special_tokens", W, "in the detokenized text", False, origin="vLLM"),
    _row("spaces_between_special_tokens", W, "in the detokenized text", False, origin="vLLM"),
    _row("include_stop_str_in_output", W, "keep the matched stop string in the text", True, origin="vLLM"),
    _row("allowed_token_ids", W, "sample only among these ids", [42, 43], origin="vLLM"),
    _row("bad_words", W, "words never generated", ["Paris"], origin="vLLM"),
    _row("prompt_logprobs", W, "returned as prompt_logprobs (completions: per choice; chat: at the top); "
         "not with stream=true, as vLLM", 1, origin="vLLM"),
    _row("truncate_prompt_tokens", W, "keep the last N prompt tokens", 4, origin="vLLM"),
    _row("priority", W, "a larger value is served sooner (see Differences from vLLM)", 1, origin="vLLM"),
    _row("request_id", W, "the response's id", "my-request-1", origin="vLLM"),
    _row("add_special_tokens", W, "add BOS etc. to the prompt (default: true for completions, false "
         "for chat, where the template adds them)", True, origin="vLLM"),
    _row("use_beam_search", W, "beam search of width n, the n beams as choices best first (streamed whole "
         "at the end); temperature defaults to 0; sampling fields it cannot honour are refused", True,
         origin="vLLM"),
    _row("length_penalty", W, "beam score = cumulative logprob / length ** length_penalty; with "
         "use_beam_search only", 1.0, origin="vLLM"),
    _row("early_stopping", W, "beam search: true stops at n finished beams, false (the default, vLLM's) "
         "when no live beam can win (heuristic), \"never\" searches to max_tokens; with use_beam_search only",
         True, origin="vLLM"),
    _row("guided_json", W, "the output follows this JSON schema (vLLM's older spelling)", {"type": "object"},
         origin="vLLM"),
    _row("guided_regex", W, "the output matches this regular expression", "[0-9]+", origin="vLLM"),
    _row("guided_choice", W, "the output is one of these strings", ["yes", "no"], origin="vLLM"),
    _row("guided_grammar", W, "the output follows this EBNF grammar (xgrammar's dialect)", "root ::= \"a\"",
         origin="vLLM"),
    _row("guided_decoding_backend", W, "xgrammar or auto (the one backend); any other is refused", "xgrammar",
         origin="vLLM"),
    _row("guided_whitespace_pattern", R, "xgrammar takes no whitespace pattern (structured_outputs."
         "disable_any_whitespace gives compact JSON)", " ", origin="vLLM"),
    _row("structural_tag", R, _STRUCTURED_TAGS, "{}", origin="vLLM"),
    _row("structured_outputs", W, "vLLM's dict: one of json, regex, choice, grammar, json_object; plus "
         "disable_any_whitespace, disable_fallback (there is nothing to fall back to)", {"regex": "[0-9]+"},
         origin="vLLM"),
    _row("logits_processors", R, "custom logits processors are not supported", ["my.Processor"], origin="vLLM"),
    _row("return_tokens_as_token_ids", R, "not implemented", True, origin="vLLM", inert=(None, False)),
    _row("return_token_ids", R, "not implemented", True, origin="vLLM", inert=(None, False)),
    _row("logprob_token_ids", R, "not implemented", [1, 2], origin="vLLM"),
    _row("truncation_side", R, "truncate_prompt_tokens keeps the last tokens (only \"left\" passes)", "right",
         origin="vLLM", inert=(None, "left")),
    _row("cache_salt", R, "prefix-cache salting is not implemented", "salt", origin="vLLM"),
    _row("kv_transfer_params", R, "disaggregated serving is not implemented", {}, origin="vLLM"),
    _row("ec_transfer_params", R, "disaggregated serving is not implemented", {}, origin="vLLM"),
    _row("vllm_xargs", R, "no extension reads them", {"k": 1}, origin="vLLM"),
    _row("watermarking", R, "not implemented", True, origin="vLLM", inert=(None, False)),
    _row("thinking_token_budget", R, "no served model reasons", 10, origin="vLLM"),
    _row("repetition_detection", R, "not implemented", {}, origin="vLLM"),
    _row("stream_interval", R, "every step's tokens are sent at once", 4, origin="vLLM"),
    _row("session_id", R, "sessions are not implemented", "s-1", origin="vLLM"),
    _row("mm_processor_kwargs", R, "multimodal input is not supported", {}, origin="vLLM"),
    _row("return_token_offsets", R, "the render endpoints are not implemented", True, origin="vLLM",
         inert=(None, False)),
    _row("return_mm_kwargs", R, "multimodal input is not supported", False, origin="vLLM", inert=(None, True)),
    _row("routed_experts_prompt_start", R, "no MoE routing data is returned", 1, origin="vLLM", inert=(None, 0)),
    # -- vLLM's extensions, completions -------------------------------------------------------------
    _row("prompt_embeds", R, "prompt embeddings are not supported", "AAAA", (COMPLETIONS,), origin="vLLM"),
    # -- vLLM's extensions, chat --------------------------------------------------------------------
    _row("best_of", R, "not served on chat (n choices are returned as they are)", 2, (CHAT,), origin="vLLM",
         inert=(None, 1)),
    _row("echo", W, "the reply starts with the last message when it is the assistant's", True, (CHAT,),
         origin="vLLM"),
    _row("add_generation_prompt", W, "passed to the chat template", True, (CHAT,), origin="vLLM"),
    _row("continue_final_message", W, "continue the last (assistant) message; not with add_generation_prompt",
         False, (CHAT,), origin="vLLM"),
    _row("chat_template", W, "a Jinja template for this request", "{{ messages[0]['content'] }}", (CHAT,),
         origin="vLLM"),
    _row("chat_template_kwargs", W, "extra variables for the chat template (not the ones set by other fields)",
         {"enable_thinking": False}, (CHAT,), origin="vLLM"),
    _row("documents", R, "not passed to the template yet", [{"title": "t", "text": "x"}], (CHAT,),
         origin="vLLM"),
    _row("media_io_kwargs", R, "multimodal input is not supported", {}, (CHAT,), origin="vLLM"),
    _row("include_reasoning", R, "no served model reasons (only true passes)", False, (CHAT,), origin="vLLM",
         inert=(None, True)),
    _row("return_prompt_text", R, "not implemented", True, (CHAT,), origin="vLLM", inert=(None, False)),
)


def fields_of(endpoint: str) -> dict[str, FieldStatus]:
    """The rows of one endpoint (``COMPLETIONS`` or ``CHAT``), by name."""
    return {f.name: f for f in FIELDS if endpoint in f.endpoints}


_BY_ENDPOINT = {endpoint: fields_of(endpoint) for endpoint in BOTH}
# Names already logged; bounded, so that clients inventing names cannot grow it without end.
_warned: set[str] = set()
_MAX_WARNED = 1024
_MAX_HEADER_NAMES = 32


def _is_inert(value: Any, inert: Iterable[Any]) -> bool:
    return any(value == v and type(value) is type(v) for v in inert if v is not None) or value is None


def check_extra_fields(endpoint: str, body: dict[str, Any]) -> list[str]:
    """The fields of ``body`` (those the request model does not declare) that this server ignores.

    Raises ValueError naming the first refused field set to anything but an inert value. The
    ignored ones (tolerated by the table, or in no row) are logged once per name per process.
    """
    rows = _BY_ENDPOINT[endpoint]
    ignored = []
    for name, value in body.items():
        row = rows.get(name)
        if row is not None and row.status is Status.REFUSED:
            if not _is_inert(value, row.inert):
                raise ValueError(f"{name}: {row.why}")
            continue
        ignored.append(name)
        if name not in _warned and len(_warned) < _MAX_WARNED:
            _warned.add(name)
            why = row.why if row is not None else "not a field this server knows"
            logger.warning("request field %r is accepted and ignored: %s", name, why)
    return ignored


def check_refused(endpoint: str, name: str, value: Any) -> None:
    """For a declared field whose row is ``refused``: ValueError naming it unless the value is inert."""
    row = _BY_ENDPOINT[endpoint][name]
    if row.status is Status.REFUSED and not _is_inert(value, row.inert):
        raise ValueError(f"{name}: {row.why}")


def ignored_fields_header(names: list[str]) -> str:
    """The ``x-ignored-fields`` value: the names comma-separated, each as a JSON string body (so a
    name with a comma, a control character or non-ASCII text cannot break the header), at most
    ``_MAX_HEADER_NAMES`` of them."""
    shown = [json.dumps(name)[1:-1].replace(",", "\\u002c") for name in names[:_MAX_HEADER_NAMES]]
    return ",".join(shown + (["..."] if len(names) > _MAX_HEADER_NAMES else []))


def markdown_table(endpoint: str, escape=lambda text: text.replace("|", "\\|")) -> str:
    """The rows of one endpoint as a Markdown table (for docs/api-fields.md)."""
    lines = ["| field | from | status | what it does / why |", "|---|---|---|---|"]
    for f in sorted(fields_of(endpoint).values(), key=lambda f: (f.origin != "OpenAI", f.name)):
        lines.append(f"| `{f.name}` | {f.origin} | {f.status.value} | {escape(f.why)} |")
    return "\n".join(lines)
