"""Request: the engine's record of one sequence being generated (pure Python, no torch).

Invariant: ``all_token_ids == prompt_token_ids + output_token_ids`` and
``0 <= num_computed_tokens <= num_tokens + num_output_placeholders``. The scheduler moves
``num_computed_tokens`` towards ``num_tokens`` (plus any draft tokens it schedules); the model
produces new tokens whenever a step brings it level. Draft tokens are never part of
``all_token_ids``: only accepted tokens are.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence. ``max_tokens`` is already clipped so prompt + output <= max_model_len."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        priority: int = 0,
        max_tokens: int | None = None,
        pooling_params: Any = None,
        lora_request: Any = None,
    ) -> None:
        self.request_id = request_id
        # A pooling request (``PoolingParams``): its prompt is computed, pooled and the request
        # finishes; ``sampling_params`` is then the engine's placeholder (one token, never sampled).
        self.pooling_params = pooling_params
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        # The adapter it runs (a pagedllm.lora LoRARequest), or None: the base model. Its
        # ``lora_int_id`` keys the prefix cache and counts against the scheduler's max_loras.
        self.lora_request = lora_request
        self.max_tokens = max_tokens if max_tokens is not None else (sampling_params.max_tokens or 1)
        # Token ids that may stop this request (its stop_token_ids, plus EOS unless ignore_eos): one
        # set lookup per sampled token; the scheduler applies the rules (min_tokens, stop reason).
        self.stop_token_candidates: frozenset[int] = frozenset(sampling_params.stop_token_ids or ()) | (
            frozenset() if sampling_params.ignore_eos or eos_token_id is None else frozenset((eos_token_id,))
        )
        # Stop strings are matched in the text, by the engine's stop checker (see Scheduler).
        self.has_stop_strings = bool(sampling_params.stop)
        # Structured output: the grammar state (structured_output.StructuredOutputRequest), set by
        # the engine core for requests with ``structured_outputs``. The scheduler only calls its
        # is_ready(), failed, accept_tokens() and is_terminated().
        self.structured_output_request = None
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens scheduled to be sampled whose ids are not known yet (async scheduling: the step
        # that samples them is still on the GPU): 1 + d for a step with d drafts, which returns
        # 1..d+1 of them. num_tokens + placeholders is what the KV will hold if all are accepted.
        self.num_output_placeholders = 0
        # Draft tokens (speculative decoding) guessing the tokens right after the last known one,
        # waiting to be scheduled. Each step that appends tokens replaces them with the runner's
        # new proposals; the scheduler drops them whole when they cannot be scheduled.
        self.spec_token_ids: list[int] = []
        # Drafts scheduled in a step whose result is not applied yet: until it is, how many of
        # them are accepted (so where the request's next token goes) is unknown.
        self.num_drafts_in_flight = 0
        self.num_cached_tokens = -1  # prefix-cache hit length, set when first scheduled
        self.stop_reason: int | str | None = None
        # Hashes of this request's full blocks (prefix caching), extended as tokens arrive.
        self.block_hashes: list[int] = []
        # When the scheduler first admitted it (RequestMetrics; the timeout_s check). The token
        # times are stamped by the engine's output processor.
        self.first_scheduled_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
