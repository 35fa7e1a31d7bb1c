"""The only data that crosses between the scheduler and the model runner (DESIGN rule 2).

SchedulerOutput goes down (diffs, not state: the runner keeps per-request state between steps);
ModelRunnerOutput comes back; EngineCoreOutput is what the scheduler reports per request per step.
All plain Python: building one costs O(number of scheduled requests + new block ids). The
per-request records are slotted dataclasses: one of each is built per request per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for: first scheduling, or resumption after preemption.

    ``output_token_ids`` is non-empty when a preempted request is resumed (its KV is recomputed).
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # A pooling request's PoolingParams (its sampling_params are the engine's placeholder); None
    # for a generation request.
    pooling_params: Any = None
    lora_request: Any = None  # a pagedllm.lora LoRARequest, or None: the base model


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already tracks: only the blocks added this step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # req_id -> number of tokens to compute this step (all scheduled requests), drafts included.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # req_id -> the draft tokens scheduled for it, in order (only requests with drafts). A request
    # with d drafts schedules 1 + d tokens: its last known token, then the d drafts.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests that finished, were aborted or were preempted since the last step: drop their state.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # req_id -> draft tokens scheduled for it this step (in order; counted in num_scheduled_tokens).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> (position, token ids): tokens appended to a scheduled request without being sampled
    # (structured output jump-forward) since the runner last saw it. The runner writes them at that
    # position of the request's tokens, replacing what it holds from there on: a token sampled in
    # flight at that position was superseded by them and is dropped.
    jump_forward_tokens: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    # Pipeline parallel only (empty otherwise): req_id -> the last tokens this step computes for a
    # request the runner already holds, from its first output position on. The stages before the
    # last never sample, so this is how they learn the sampled tokens (vLLM's ``new_token_ids``).
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities at one position: ``token_ids[0]`` is the chosen token, then the top-k.

    ``ranks[i]`` is the 1-based rank of ``token_ids[i]`` in the distribution.
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # Per request (same order as req_ids): the tokens accepted this step. [] for a partial prefill;
    # [t] for a plain decode; with d drafts scheduled, 1..d+1 tokens (the drafts accepted up to the
    # first rejection, then the token sampled there).
    sampled_token_ids: list[list[int]]
    # Per request: logprobs of each sampled token (only when the request asked for logprobs).
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # req_id -> logprobs of the prompt positions computed this step (prompt_logprobs requests).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # req_id -> drafts the runner's proposer made for the next step (None: no proposer).
    draft_token_ids: dict[str, list[int]] | None = None
    # req_id -> the pooled vector (an opaque CPU tensor, never read here) of each pooling request
    # whose prompt was fully computed this step; None on a generation runner.
    pooler_output: dict[str, Any] | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """What happened to one request in one step."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    pooling_output: Any = None  # a finished pooling request's vector (opaque, from the runner)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
