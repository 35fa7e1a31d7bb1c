"""Request bodies of the OpenAI-compatible API (pydantic), with vLLM's extra sampling fields.

Which fields exist and what happens to each is decided by the table in ``field_status.py``: the
models here declare the fields that work (and the refused ones that have an inert value, such as
``response_format: {"type": "text"}``); any other field is checked against the table by
``check_fields`` (refused -> ValueError naming it; else ignored and reported).
Types are strict, as OpenAI's: no str -> int or bool -> int coercion, no NaN or infinity, but an
integer is a valid float (a wrong type is a 400 naming the field). Ranges are checked by
SamplingParams / BeamSearchParams, whose ValueErrors start with the field's name. Responses are
plain dicts built by the serving modules, in OpenAI's wire format.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, Strict

from pagedllm.beam_search import BeamSearchParams
from pagedllm.entrypoints.chat_utils import Role
from pagedllm.entrypoints.openai.field_status import CHAT, COMPLETIONS, check_extra_fields, check_refused
from pagedllm.entrypoints.openai.structured_outputs import CONSTRAINT_FIELDS, Constraint, request_constraint
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Float = Annotated[float, Strict(), AllowInfNan(False)]  # an int is accepted, NaN and inf are not
Str = Annotated[str, Strict()]


class OpenAIBaseModel(BaseModel):
    # Undeclared fields are kept (model_extra) for check_fields to judge against the field table.
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBaseModel):
    include_usage: Bool | None = False
    continuous_usage_stats: Bool | None = False


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    ENDPOINT: ClassVar[str] = COMPLETIONS  # which column of the field table judges the undeclared fields

    model: Str | None = None
    n: Int = 1
    frequency_penalty: Float | None = 0.0
    presence_penalty: Float | None = 0.0
    logit_bias: dict[str, Float] | None = None
    seed: Int | None = None
    stop: Str | list[Str] | None = None
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extra body fields
    structured_outputs: dict[str, Any] | None = None
    guided_json: Str | dict[str, Any] | None = None
    guided_regex: Str | None = None
    guided_choice: list[Str] | None = None
    guided_grammar: Str | None = None
    guided_decoding_backend: Str | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    ignore_eos: Bool = False
    min_tokens: Int = 0
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: Bool = True
    spaces_between_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    allowed_token_ids: list[Int] | None = None
    bad_words: list[Str] | None = None
    prompt_logprobs: Int | None = None
    truncate_prompt_tokens: Int | None = Field(default=None, ge=1)
    priority: Int = 0
    request_id: Str | None = None
    # vLLM's beam search (V0's fields): beam width = n
    use_beam_search: Bool = False
    length_penalty: Float = 1.0
    early_stopping: Bool | Literal["never"] = False

    def check_fields(self) -> list[str]:
        """The undeclared fields this server ignores; ValueError naming a refused one."""
        return check_extra_fields(self.ENDPOINT, self.model_extra or {})

    def constraint(self, tool_schema: dict | None = None) -> Constraint | None:
        """The output constraint this request asks for (see ``structured_outputs.py``)."""
        return request_constraint({name: getattr(self, name) for name in (*CONSTRAINT_FIELDS,
                                                                          "guided_decoding_backend")}, tool_schema)

    def _check_common(self, max_logprobs: int, max_num_seqs: int) -> None:
        """vLLM's and OpenAI's cross-field rules; each ValueError starts with the field's name."""
        if self.n > max_num_seqs:
            raise ValueError(f"n must be at most {max_num_seqs} (the engine's max_num_seqs), got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream=true")
        if self.prompt_logprobs is not None:
            if self.stream:
                raise ValueError("prompt_logprobs: not available with stream=true")
            if not 0 <= self.prompt_logprobs <= max_logprobs:
                raise ValueError(f"prompt_logprobs must be in [0, {max_logprobs}], got {self.prompt_logprobs}")

    def _check_no_beam_fields(self) -> None:
        for name in ("length_penalty", "early_stopping"):
            if name in self.model_fields_set and getattr(self, name) != type(self).model_fields[name].default:
                raise ValueError(f"{name}: applies to beam search only (set use_beam_search=true)")

    def _beam_search_params(self, max_logprobs: int, max_num_seqs: int, max_tokens: int) -> BeamSearchParams:
        """Beam search of width ``n``; the sampling fields it cannot honour are refused by name."""
        self._check_common(max_logprobs, max_num_seqs)
        constraint = self.constraint()
        if constraint is not None:
            raise ValueError(f"{constraint.field}: not supported with use_beam_search")
        fields = type(self).model_fields
        for name in _NOT_WITH_BEAM_SEARCH:
            if name in fields and name in self.model_fields_set and getattr(self, name) != fields[name].default:
                raise ValueError(f"{name}: not supported with use_beam_search")
        if 2 * self.n > max_logprobs:
            raise ValueError(f"n (the beam width) must be at most {max_logprobs // 2} (max_logprobs / 2) with "
                             f"use_beam_search, got {self.n}")
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                temperature=_default(self.temperature, 0.0), length_penalty=self.length_penalty,
                                include_stop_str_in_output=self.include_stop_str_in_output,
                                early_stopping=self.early_stopping)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                         constraint: Constraint | None) -> SamplingParams:
        """Build validated SamplingParams (ValueError naming the field on a bad value)."""
        stream = bool(self.stream)
        return SamplingParams(
            n=self.n,
            presence_penalty=_default(self.presence_penalty, 0.0),
            frequency_penalty=_default(self.frequency_penalty, 0.0),
            repetition_penalty=_default(self.repetition_penalty, 1.0),
            temperature=_default(self.temperature, 1.0),
            top_p=_default(self.top_p, 1.0),
            top_k=_default(self.top_k, 0),
            min_p=_default(self.min_p, 0.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            bad_words=self.bad_words,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=_logit_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=constraint.params if constraint is not None else None,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)


# Sampling fields beam search has no use for: set to anything but their default, they are refused
# with use_beam_search rather than ignored (vLLM drops them silently).
_NOT_WITH_BEAM_SEARCH = ("frequency_penalty", "presence_penalty", "logit_bias", "seed", "stop", "top_p",
                         "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids",
                         "allowed_token_ids", "bad_words", "prompt_logprobs", "logprobs",
                         "spaces_between_special_tokens", "top_logprobs")


class CompletionRequest(_SamplingFields):
    ENDPOINT: ClassVar[str] = COMPLETIONS

    prompt: Str | list[Int] | list[Str] | list[list[Int]]
    best_of: Int | None = None
    echo: Bool | None = False
    logprobs: Int | None = None
    max_tokens: Int | None = 16
    suffix: Str | None = None
    add_special_tokens: Bool = True

    def to_sampling_params(self, max_logprobs: int, max_num_seqs: int) -> SamplingParams:
        self._check_common(max_logprobs, max_num_seqs)
        check_refused(COMPLETIONS, "suffix", self.suffix)
        if self.logprobs is not None and self.logprobs > max_logprobs:
            raise ValueError(f"logprobs must be at most {max_logprobs}, got {self.logprobs}")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n (other values are not supported), got best_of={self.best_of}")
        self._check_no_beam_fields()
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = self.logprobs  # echo with logprobs reports the prompt's too
        return self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs, self.constraint())

    def to_beam_search_params(self, max_logprobs: int, max_num_seqs: int, max_tokens: int) -> BeamSearchParams:
        """``max_tokens``: the request's, or what the context leaves."""
        check_refused(COMPLETIONS, "suffix", self.suffix)
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n (the beam width), got best_of={self.best_of}")
        return self._beam_search_params(max_logprobs, max_num_seqs, max_tokens)


class ChatMessage(OpenAIBaseModel):
    """One message; its content rules (required unless the assistant's, text parts only) and its
    tool fields (``tool_calls`` on an assistant message, ``tool_call_id`` on a tool result) are
    checked with the conversation by ``chat_utils.text_messages``."""

    role: Role
    content: Str | list[dict[str, Any]] | None = None
    name: Str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: Str | None = None


class ChatCompletionRequest(_SamplingFields):
    ENDPOINT: ClassVar[str] = CHAT

    messages: list[ChatMessage]
    logprobs: Bool | None = False
    top_logprobs: Int | None = None
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    # vLLM's extras
    chat_template_kwargs: dict[str, Any] | None = None
    echo: Bool = False
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template: Str | None = None
    add_special_tokens: Bool = False

    def to_sampling_params(self, max_logprobs: int, max_num_seqs: int,
                           tool_schema: dict | None = None) -> SamplingParams:
        """``tool_schema``: the JSON schema a ``required`` or named ``tool_choice`` forces."""
        self._check_common(max_logprobs, max_num_seqs)
        self._check_no_beam_fields()
        self._check_chat()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs requires logprobs to be true")
            if not 0 <= self.top_logprobs <= max_logprobs:
                raise ValueError(f"top_logprobs must be in [0, {max_logprobs}], got {self.top_logprobs}")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(self.requested_max_tokens, logprobs, self.prompt_logprobs,
                                     self.constraint(tool_schema))

    def to_beam_search_params(self, max_logprobs: int, max_num_seqs: int, max_tokens: int) -> BeamSearchParams:
        """``max_tokens``: the request's, or what the context leaves."""
        self._check_chat()
        if self.tools and self.tool_choice != "none":
            raise ValueError("tools: not supported with use_beam_search (unless tool_choice is 'none')")
        return self._beam_search_params(max_logprobs, max_num_seqs, max_tokens)

    def _check_chat(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt=true")
        max_tokens = self.requested_max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"{self.max_tokens_field} must be at least 1, got {max_tokens}")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


ErrorType = Literal["invalid_request_error", "authentication_error", "not_found_error", "server_error",
                    "overloaded_error"]


def _default(value, default):
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    out = {}
    for k, v in bias.items():
        try:
            out[int(k)] = float(v)
        except (TypeError, ValueError) as e:
            raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from e
        if not -100.0 <= v <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {v}")
    return out
