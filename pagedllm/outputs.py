"""RequestOutput and CompletionOutput: what step() / generate() hand back (the seed spec's fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class Logprob(NamedTuple):
    """One token's log-probability, its rank in the distribution (1 = most likely), and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# ``CompletionOutput.stop_reason`` of a sequence finished with finish_reason "abort" because it
# waited in the queue longer than the engine's ``timeout_s`` without being scheduled (the OpenAI
# server answers 503 for it). Unambiguous: a matched stop string comes with finish_reason "stop".
QUEUE_TIMEOUT_REASON = "queue_timeout"

# One dict per position: token id -> Logprob (the chosen token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class RequestMetrics:
    """When a request went through the engine (vLLM's fields; seconds on the ``time.time()`` clock).

    ``arrival_time`` is set at ``add_request``; the others stay ``None`` until the event happens:
    first scheduled (left the waiting queue), first token produced, latest token produced, finished.
    ``time_in_queue`` = ``first_scheduled_time - arrival_time``.
    """

    arrival_time: float
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # matched stop string / stop token id; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # Timings differ from run to run: left out of equality (two runs' outputs compare equal).
    metrics: RequestMetrics | None = field(default=None, repr=False, compare=False)


# -- pooling (embedding) requests: vLLM's shapes ------------------------------------------------
@dataclass
class PoolingOutput:
    """A pooling request's result: ``data`` is the pooled vector (a float32 CPU ``torch.Tensor``)."""

    data: object


@dataclass
class EmbeddingOutput:
    """An embedding as vLLM's ``LLM.embed`` returns it: ``embedding`` is a list of floats."""

    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> EmbeddingOutput:
        return cls(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingRequestOutput:
    """What ``LLMEngine.step`` returns for a pooling request (``LLM.encode``'s items): one output,
    when it finishes. An aborted request ends with ``outputs`` None."""

    request_id: str
    outputs: PoolingOutput | None
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed``'s items: ``outputs.embedding`` is the vector as a list of floats."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        if output.outputs is None:
            raise ValueError(f"request {output.request_id!r} was aborted: it has no embedding")
        return cls(output.request_id, EmbeddingOutput.from_base(output.outputs), output.prompt_token_ids,
                   output.finished)
