"""The engine side of pooling requests: validation, bookkeeping and their outputs.

A pooling request is queued like a generation request whose one "token" is never sampled: its
``Request`` carries the ``PoolingParams`` (``normalize`` resolved from the model's
``PoolerConfig``) and a placeholder ``SamplingParams(max_tokens=1)``. When its prompt has been
computed the runner returns its vector and the scheduler finishes it ("stop") and frees its
blocks; ``PoolingRequests.process`` turns that into a ``PoolingRequestOutput``.
"""

from __future__ import annotations

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.outputs import PoolingOutput, PoolingRequestOutput
from pagedllm.sampling_params import SamplingParams

# What the scheduler reads of a pooling request's sampling params: one token, no stop rules.
POOLING_PLACEHOLDER_PARAMS = SamplingParams(max_tokens=1, detokenize=False)


def validate_pooling_prompt(ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """ValueError naming ``prompt`` / ``prompt_token_ids`` for ids outside the vocabulary or a
    prompt longer than ``max_model_len`` (a pooling prompt may fill it: nothing is generated)."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):  # C-level scans; the list only on failure
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        raise ValueError(f"prompt_token_ids contains ids outside the vocabulary (size {vocab_size}): {bad[:5]}")
    if len(ids) > max_model_len:
        raise ValueError(f"prompt is too long: {len(ids)} tokens, but max_model_len is {max_model_len}")


class PoolingRequests:
    """The live pooling requests of an engine: request id -> prompt token ids.

    Invariant: an id is here from ``add`` until its final output is built (finished or aborted).
    Cost: O(1) per request added, per output and per abort."""

    def __init__(self) -> None:
        self.prompts: dict[str, list[int]] = {}

    def add(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.prompts[request_id] = prompt_token_ids

    def has_request(self, request_id: str) -> bool:
        return request_id in self.prompts

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> list[PoolingRequestOutput]:
        """The final outputs of the requests that finished this step (``outputs None`` for one the
        scheduler aborted, e.g. a queue timeout)."""
        results = []
        for out in outputs:
            if out.finish_reason is None or out.req_id not in self.prompts:
                continue
            data = PoolingOutput(out.pooling_output) if out.pooling_output is not None else None
            results.append(PoolingRequestOutput(out.req_id, data, self.prompts.pop(out.req_id), True,
                                                out.num_cached_tokens))
        return results

    def finish_aborted(self, request_ids: list[str]) -> list[PoolingRequestOutput]:
        return [PoolingRequestOutput(r, None, self.prompts.pop(r), True) for r in request_ids if r in self.prompts]
