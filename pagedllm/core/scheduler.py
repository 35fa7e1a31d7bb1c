"""Scheduler: one token budget per step, shared by every request (DESIGN rule 1).

There is no prefill phase and no decode phase. A request has ``num_computed_tokens`` (KV written)
and ``num_tokens`` (prompt + output so far); each step hands out at most
``max_num_batched_tokens`` tokens to at most ``max_num_seqs`` requests so that the first catches
up with the second. A decode is a request one token behind; a prefill is one many tokens behind
and may be split over steps (chunked prefill); a prefix-cache hit starts ``num_computed_tokens``
above zero; preemption by recompute sets it back to zero. Mixed batches are the normal case.

One step, in order:
1. Running requests, in policy order, each get ``min(num_tokens - num_computed_tokens, budget)``.
   If the KV pool has no room, the lowest-ranked running request (the back of the running queue,
   possibly the request itself) is preempted until it fits.
2. Waiting requests, in policy order, only if nobody was preempted in this step: prefix-cache
   lookup, then as many tokens as the budget allows. The queue never skips ahead: if the head
   cannot be allocated (or, without chunked prefill, does not fit the rest of the budget),
   nothing behind it is admitted either. The exceptions: a request whose grammar
   (structured output) is still compiling is passed over, holding nothing, until it is ready
   (one whose grammar failed to compile is finished as FINISHED_ABORTED); with LoRA, a request
   whose adapter would make the running requests' distinct adapters more than ``max_loras`` is
   passed over (vLLM's rule: a step never runs more adapters than the worker has slots).

Semantics fixed here:
- ``num_computed_tokens`` advances in ``schedule()`` (as in vLLM): the output carries each
  request's value *before* the step; ``update_from_output`` only appends accepted tokens (and
  takes rejected drafts back). A step that ends inside the prompt (partial prefill) returns an
  empty sampled list for that request.
- Full blocks enter the prefix cache in ``update_from_output``, after the runner wrote their KV,
  so a hit never depends on KV being written in the same forward pass.
- Ids of requests that finished or were aborted (``finish_requests``) since the
  previous ``schedule()`` go out in the next ``SchedulerOutput.finished_req_ids``; the runner
  drops their state (before it adds ``scheduled_new_reqs``). Preempted ids go out in the same
  step's ``preempted_req_ids``; a preempted request is never re-admitted in the step that
  preempted it, and comes back as a ``NewRequestData`` carrying its output tokens so far.
- Draft tokens (speculative decoding): a request one token behind with drafts
  (``Request.spec_token_ids``, from the previous step's ``ModelRunnerOutput.draft_token_ids``)
  schedules its last token plus all its drafts, or none of the drafts when they do not fit the
  budget, the length limits or the KV pool; its ``num_computed_tokens`` then runs ahead by the
  drafts (one rule, more tokens), and ``update_from_output`` rolls it back by the number rejected.
  The runner returns the accepted tokens (1..d+1); stops (EOS, stop ids, max_tokens, stop strings)
  apply token by token inside that list, and the tokens after a stop are dropped. With async
  scheduling a request with drafts in flight, or with drafts guessing where a token in flight
  goes, waits for that step's result (it is skipped for one step).
- Stop strings are decided in ``update_from_output`` too: for requests with stop strings the
  engine's ``stop_checker`` (which owns the detokenizer state) is asked about each step's tokens,
  so a stopped request is freed in the update that sees its tokens; with async scheduling the
  result of the step still in flight for it is then ignored (its token is never emitted).
- Structured output: ``Request.structured_output_request`` (None for most requests) is advanced
  by each step's kept tokens in ``update_from_output``; the request finishes with "stop" when
  its grammar terminates, and as aborted if the grammar refuses a token (its bitmask was not
  applied: never expected). Jump-forward: the tokens the grammar then forces
  (``jump_forward()``, structured_output/jump_forward.py) are appended in the same update, before
  its stop strings are checked; having no KV, they are computed by the next step that schedules
  the request (the one rule), whose ``SchedulerOutput.jump_forward_tokens`` tells the runner
  their ids. With async scheduling the step in flight samples where the first jumped token now
  is: that sample is superseded (its placeholder is taken back now, its result ignored later).
- Sequences of an n > 1 request are added together (``add_request(first, siblings)``); the
  siblings wait until the first has computed the prompt, so that they hit its prefix cache.
- ``timeout_s`` (when set): a request that has waited that long since its arrival without ever
  being scheduled is finished as FINISHED_ABORTED with stop reason ``QUEUE_TIMEOUT_REASON`` at the
  start of a ``schedule()`` and reported by the next update; it holds no blocks. A request that
  was scheduled once (running, or preempted and waiting again) never times out: its wait is over.
- A request whose tokens need more blocks than the whole pool holds (or, without chunked prefill,
  more tokens than a whole step's budget) can never run; rather than block the queue forever it
  is finished as FINISHED_ABORTED when it reaches the head of the waiting queue, and reported
  (finish_reason "abort") by the next ``update_from_output``. The engine must therefore call
  ``update_from_output`` after every ``schedule()``, even an empty one.
- Micro-batches (pipeline parallel, ``schedule_micro_batches(depth)``): up to ``depth`` steps are
  in flight at once, each over requests no other step in flight holds (``_in_flight``, cleared by
  the step's update), so that every stage works on one micro-batch while the next stage works on
  another. A step takes at most ``ceil(unfinished running and waiting requests / depth)``
  requests, which splits a batch evenly over the micro-batches. A request preempted while its step
  is in flight is re-admitted only after that step's update (its stale result is then dropped).
  Each step carries ``new_token_ids``: the output tokens it computes, which the stages before the
  last (they never sample) learn from it.
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.outputs import QUEUE_TIMEOUT_REASON
from pagedllm.request import Request, RequestStatus

# Enum members as module constants: attribute access on an Enum class is slow in the hot loops.
_RUNNING = RequestStatus.RUNNING
_FINISHED_STOPPED = RequestStatus.FINISHED_STOPPED
_FINISHED_LENGTH = RequestStatus.FINISHED_LENGTH

# (request id, the tokens appended to it this step, whether its last token stopped it) -> None, or
# (how many of those tokens to keep, the stop string that the last kept one completes).
StopChecker = Callable[[str, list[int], bool], "tuple[int, str] | None"]


@dataclass
class SpecDecodingStats:
    """Speculative decoding's totals since start-up (vLLM's ``spec_decode_*`` counters): a draft is
    one request's run of draft tokens verified in one step. Invariant: ``num_accepted_tokens ==
    sum(num_accepted_tokens_per_pos) <= num_draft_tokens``; ``num_accepted_tokens_per_pos[j]``
    counts drafts whose token j was accepted. Cost: O(accepted) per verified draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for j in range(num_accepted):
            per_pos[j] += 1

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.num_accepted_tokens_per_pos))

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step gives a request on average: the accepted drafts plus the one
        sampled after them (vLLM's definition; 1.0 before any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions_total: int
    spec_decoding: SpecDecodingStats | None = None  # None until a runner has returned drafts


class RequestQueue:
    """Requests kept sorted by a policy key: the front is scheduled first, the back preempted first.

    Invariant: ``_keys`` is sorted and unique (the key ends in an insertion number) and
    ``_requests[i]`` has key ``_keys[i]``. Cost: add / remove / popleft O(n) (binary search plus a
    list shift, fast for the few thousand requests an engine holds); peek, pop (back), len O(1).
    """

    def __init__(self, key: Callable[[Request], tuple]) -> None:
        self._key = key
        self._keys: list[tuple] = []
        self._requests: list[Request] = []

    def add(self, request: Request) -> None:
        key = self._key(request)
        i = bisect.bisect_left(self._keys, key)
        self._keys.insert(i, key)
        self._requests.insert(i, request)

    def remove(self, request: Request) -> None:
        i = bisect.bisect_left(self._keys, self._key(request))
        if i == len(self._requests) or self._requests[i] is not request:
            raise ValueError(f"{request} is not in the queue")
        del self._keys[i]
        del self._requests[i]

    def peek(self) -> Request:
        return self._requests[0]

    def popleft(self) -> Request:
        del self._keys[0]
        return self._requests.pop(0)

    def pop(self) -> Request:
        self._keys.pop()
        return self._requests.pop()

    def __getitem__(self, i: int) -> Request:
        return self._requests[i]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.snapshot())

    def snapshot(self) -> list[Request]:
        """The requests in order, as a new list (the queue may change while it is walked)."""
        return list(self._requests)

    def is_sorted(self) -> bool:
        return all(a < b for a, b in zip(self._keys, self._keys[1:]))


class Scheduler:
    """Decides, each step, which requests compute how many tokens, and applies the results.

    Invariant (``check_integrity``): every unfinished request is in exactly one of ``waiting``
    (WAITING/PREEMPTED, no blocks, nothing computed), ``running`` (RUNNING, blocks covering its
    computed tokens) or the held siblings (WAITING, like ``waiting``, behind a first sequence
    still computing their common prompt); ``len(running) <= max_num_seqs``; block ref counts
    match holders.
    Policy order: "priority" = larger ``priority`` first, then earlier ``arrival_time``, then
    insertion order; "fcfs" = earlier ``arrival_time``, then insertion order.
    Cost per step: O(scheduled requests + their new blocks + prefix-lookup blocks), plus O(n) list
    shifts for queue insertions and removals.
    """

    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, stop_checker: StopChecker | None = None
    ) -> None:
        if scheduler_config.scheduling_policy not in ("priority", "fcfs"):
            raise ValueError(f"scheduling_policy must be 'priority' or 'fcfs', got {scheduler_config.scheduling_policy!r}")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            cache_config.block_size, cache_config.num_blocks, cache_config.enable_prefix_caching,
            cache_config.sliding_window,
        )
        self.requests: dict[str, Request] = {}
        self._insertion_number: dict[str, int] = {}
        self._num_added = 0
        self.waiting = RequestQueue(self._policy_key)
        self.running = RequestQueue(self._policy_key)
        # First sequence id -> its n / best_of siblings, queued once it has computed the prompt.
        self._held_siblings: dict[str, list[Request]] = {}
        self.stop_checker = stop_checker
        # Set once a runner returns drafts: until then the hot loops skip every draft test.
        self._drafts_seen = False
        self.spec_decoding_stats = SpecDecodingStats()
        self._num_with_stop_strings = 0  # unfinished requests with stop strings
        self._num_structured = 0  # unfinished requests with a grammar (structured output)
        # Jump-forward: tokens appended without sampling, not yet sent to the runner (req_id ->
        # (position, ids)), and requests whose sample in flight a jump superseded.
        self._jump_forward_tokens: dict[str, tuple[int, list[int]]] = {}
        self._superseded_samples: set[str] = set()
        # Finished since the previous schedule(): sent to the runner in the next SchedulerOutput.
        self.finished_req_ids: set[str] = set()
        # Finished inside schedule() (could never fit): reported by the next update_from_output.
        self._pending_outputs: list[EngineCoreOutput] = []
        self.num_preemptions_total = 0
        # With timeout_s: (arrival_time, insertion number, request id) of every request added, a
        # min-heap, so the front is the first that can time out. An entry whose request was
        # scheduled or finished meanwhile is dropped when it reaches the front (ids, not requests:
        # a finished request is not kept alive by its entry). Cost: O(log n) per request added;
        # O(1) per step while nobody times out.
        self._arrivals: list[tuple[float, int, str]] = []
        # Micro-batches (module doc): ids of the requests of launched steps not yet updated, and the
        # most requests one step takes; None / unused without them (no cost then).
        self._in_flight: set[str] | None = None
        self._micro_batch_depth = 1
        self._micro_batch_cap = scheduler_config.max_num_seqs

    def schedule_micro_batches(self, depth: int) -> None:
        """From now on up to ``depth`` scheduled steps may be in flight at once, over disjoint
        requests (module doc: micro-batches); ``depth`` 1 runs one step at a time on the same path."""
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self._micro_batch_depth = depth
        if self._in_flight is None:
            self._in_flight = set()

    @property
    def num_in_flight(self) -> int:
        """Requests (ids) of micro-batches launched and not yet updated (0 without micro-batches)."""
        return len(self._in_flight) if self._in_flight is not None else 0

    @property
    def block_pool(self) -> BlockPool:
        return self.kv_cache_manager.block_pool

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; refused (False) while any request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def _policy_key(self, request: Request) -> tuple:
        order = self._insertion_number[request.request_id]
        if self.scheduler_config.scheduling_policy == "priority":
            return (-request.priority, request.arrival_time, order)
        return (request.arrival_time, order)

    # -- requests in and out -----------------------------------------------------------------
    def add_request(self, request: Request, siblings: Sequence[Request] = ()) -> None:
        """Queue ``request``, and its ``siblings``: the other sequences of an n / best_of > 1
        request (same prompt). When the prompt fills a block and prefix caching is on, the
        siblings wait until ``request`` has computed the prompt, so that they find its full blocks
        in the prefix cache and share them instead of each computing the prompt again."""
        group = [request, *siblings]
        ids = [r.request_id for r in group]
        for req_id in ids:
            if req_id in self.requests or ids.count(req_id) > 1:
                raise ValueError(f"request_id {req_id!r} is already in use")
        for r in group:
            self.requests[r.request_id] = r
            self._num_with_stop_strings += r.has_stop_strings
            self._num_structured += r.structured_output_request is not None
            self._insertion_number[r.request_id] = self._num_added
            if self.scheduler_config.timeout_s is not None:
                heapq.heappush(self._arrivals, (r.arrival_time, self._num_added, r.request_id))
            self._num_added += 1
            r.status = RequestStatus.WAITING
        self.waiting.add(request)
        shareable = request.num_prompt_tokens > self.block_size and self.kv_cache_manager.enable_caching
        if siblings and shareable:
            self._held_siblings[request.request_id] = list(siblings)
        else:
            for sibling in siblings:
                self.waiting.add(sibling)

    def _queue_siblings(self, req_id: str) -> None:
        for sibling in self._held_siblings.pop(req_id):
            self.waiting.add(sibling)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside (abort): free blocks, forget them.

        Idempotent; unknown or already finished ids are ignored. Returns the requests finished now.
        """
        if not RequestStatus.is_finished(status):
            raise ValueError(f"status must be a finished status, got {status!r}")
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        finished = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif not self._unhold(request):
                self.waiting.remove(request)
            request.status = status
            self._release(request)
            finished.append(request)
        return finished

    def _unhold(self, request: Request) -> bool:
        """Take ``request`` out of the held siblings; False if it was not held."""
        for first_id, siblings in self._held_siblings.items():
            if request in siblings:
                siblings.remove(request)
                if not siblings:
                    del self._held_siblings[first_id]
                return True
        return False

    def _release(self, request: Request) -> None:
        """Forget a finished request: free its blocks, queue the siblings it held back; the runner
        hears of it next step."""
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        del self._insertion_number[request.request_id]
        self._num_with_stop_strings -= request.has_stop_strings
        if request.structured_output_request is not None:
            self._num_structured -= 1
            self._forget_jumps(request.request_id)
        self.finished_req_ids.add(request.request_id)
        if self._held_siblings and request.request_id in self._held_siblings:
            self._queue_siblings(request.request_id)

    def _forget_jumps(self, req_id: str) -> None:
        self._jump_forward_tokens.pop(req_id, None)
        self._superseded_samples.discard(req_id)

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)  # waiting + running + held siblings (check_integrity)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_finished_requests(self) -> bool:
        """Finished ids the runner has not heard of yet (step once more to deliver them)."""
        return bool(self.finished_req_ids) or bool(self._pending_outputs)

    # -- schedule ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self._arrivals:
            self._expire_timed_out(time.time())
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        running = self.running.snapshot()
        if self._in_flight is not None:
            running = self._micro_batch_candidates(running)
        self._schedule_tokens(out, running, out.scheduled_cached_reqs)  # running requests
        if not out.preempted_req_ids and len(self.waiting):
            self._schedule_waiting(out)
        if self._jump_forward_tokens:
            self._send_jump_forward_tokens(out)
        if self._in_flight is not None:
            self._launch_micro_batch(out)
        return out

    def _micro_batch_candidates(self, running: list[Request]) -> list[Request]:
        """The running requests this micro-batch may schedule: those not in flight, at most its
        share of the unfinished requests (which also caps the waiting ones it admits)."""
        in_flight = self._in_flight
        self._micro_batch_cap = cap = -(-(len(self.running) + len(self.waiting)) // self._micro_batch_depth)
        return [r for r in running if r.request_id not in in_flight][:cap]

    def _launch_micro_batch(self, out: SchedulerOutput) -> None:
        """Note the step's requests as in flight and give it the output tokens it computes for the
        requests the runner already holds (``SchedulerOutput.new_token_ids``): none of them is in
        flight, so each of those tokens is known here. O(scheduled requests)."""
        scheduled = out.num_scheduled_tokens
        self._in_flight.update(scheduled)
        requests = self.requests
        for record in out.scheduled_cached_reqs:
            request = requests[record.req_id]
            start = record.num_computed_tokens
            end = start + scheduled[record.req_id]
            first = max(start, request.num_prompt_tokens)
            if end > first:
                out.new_token_ids[record.req_id] = request.all_token_ids[first:end]

    def _send_jump_forward_tokens(self, out: SchedulerOutput) -> None:
        """Hand the runner the jumped tokens of the requests scheduled in ``out`` (the others keep
        theirs until they are scheduled)."""
        pending = self._jump_forward_tokens
        for req_id in [r for r in pending if r in out.num_scheduled_tokens]:
            out.jump_forward_tokens[req_id] = pending.pop(req_id)

    def _budget_left(self, out: SchedulerOutput) -> int:
        return self.scheduler_config.max_num_batched_tokens - out.total_num_scheduled_tokens

    def _schedule_tokens(self, out: SchedulerOutput, requests: list[Request], records: list[CachedRequestData]) -> None:
        """Give each running request of ``requests``, in order, ``min(uncomputed tokens, budget
        left)`` tokens (plus its drafts when they fit), appending its CachedRequestData to
        ``records`` and advancing its ``num_computed_tokens`` (the record carries the value
        before the step). A step that brings a request level with its tokens samples for it:
        1 + d placeholders (d drafts), of which the result keeps the accepted ones.

        The one place that counts scheduled tokens (admission calls it too), and the hot loop of
        every decode step: attributes are read into locals. Decode fast path: tokens that fit in
        the blocks a request already holds need no call to ``allocate_slots`` (it would return
        no new blocks and change nothing).
        """
        config = self.scheduler_config
        max_batched, max_model_len = config.max_num_batched_tokens, config.max_model_len
        chunked = config.enable_chunked_prefill
        block_size = self.block_size
        req_to_blocks = self.kv_cache_manager.req_to_blocks
        num_scheduled = out.num_scheduled_tokens
        budget = max_batched - out.total_num_scheduled_tokens
        drafts_seen = self._drafts_seen
        for request in requests:
            if budget <= 0:
                break
            # Tokens whose KV is still to be computed, counting sampled-but-unseen tokens (async
            # scheduling); none when the token in flight is the request's last (length limits).
            pending = request.num_output_placeholders
            num_tokens = len(request.all_token_ids)
            if pending and (
                # Drafts in flight: how many tokens that step returns is unknown. Drafts waiting:
                # they guess where the token in flight goes. Either way, wait for that step.
                (drafts_seen and (request.num_drafts_in_flight or request.spec_token_ids))
                or len(request.output_token_ids) + pending >= request.max_tokens
                or num_tokens + pending >= max_model_len
            ):
                continue
            num_drafts = self._num_drafts_that_fit(request, budget) if drafts_seen and request.spec_token_ids else 0
            # Computed tokens catch up with this: known + in flight + drafts (all fit, or none).
            level = num_tokens + pending + num_drafts
            num_computed = request.num_computed_tokens
            num_remaining = level - num_computed
            num_new_tokens = num_remaining if num_remaining < budget else budget
            if num_new_tokens <= 0 or (not chunked and num_new_tokens < num_remaining):
                continue  # nothing to do, or a prefill that must not be split: it waits
            req_id = request.request_id
            if num_computed + num_new_tokens <= len(req_to_blocks[req_id]) * block_size:
                new_block_ids: list[int] = []
            else:
                allocated = self._allocate_or_preempt(request, num_new_tokens - num_drafts, num_drafts, out)
                if allocated is None:
                    break  # it preempted itself: it was the back of the queue, nobody is left
                new_block_ids = allocated
                if num_drafts and not request.spec_token_ids:  # the pool had no room for them
                    num_new_tokens, level, num_drafts = num_new_tokens - num_drafts, level - num_drafts, 0
                while requests and requests[-1].status != _RUNNING:  # the preempted victims (the back)
                    requests.pop()
            records.append(CachedRequestData(req_id, new_block_ids, num_computed))
            num_scheduled[req_id] = num_new_tokens
            budget -= num_new_tokens
            num_computed += num_new_tokens
            request.num_computed_tokens = num_computed
            if num_computed == level:  # this step samples for it: 1 + drafts tokens, at most
                request.num_output_placeholders = level - num_tokens + 1
                if num_drafts:
                    out.scheduled_spec_decode_tokens[req_id] = request.spec_token_ids
                    request.spec_token_ids = []
                    request.num_drafts_in_flight = num_drafts
        out.total_num_scheduled_tokens = max_batched - budget

    def _num_drafts_that_fit(self, request: Request, budget: int) -> int:
        """How many drafts to schedule with the request's last token: all of them, or none (they
        are dropped) when the request is not one token behind, or they do not fit the budget, or
        accepting all of them could pass ``max_tokens`` or ``max_model_len``."""
        num_tokens = 1 + len(request.spec_token_ids)  # computed, and at most returned, this step
        if (
            request.num_computed_tokens + 1 != request.num_tokens
            or num_tokens > budget
            or request.num_output_tokens + num_tokens > request.max_tokens
            or request.num_tokens + num_tokens > self.scheduler_config.max_model_len
        ):
            request.spec_token_ids = []
            return 0
        return num_tokens - 1

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, num_drafts: int, out: SchedulerOutput
    ) -> list[int] | None:
        """Allocate, preempting from the back of the running queue until it fits.

        Drafts get lookahead slots when the pool has room; otherwise they are dropped (a guess is
        not worth a preemption). Returns the new block ids, or None if ``request`` itself had to
        be preempted. Victims always come after ``request`` in the running queue, so none was
        scheduled this step.
        """
        kv = self.kv_cache_manager
        if num_drafts:
            new_block_ids = kv.allocate_slots(request, num_new_tokens, num_lookahead_tokens=num_drafts)
            if new_block_ids is not None:
                return new_block_ids
            request.spec_token_ids = []
        while True:
            new_block_ids = kv.allocate_slots(request, num_new_tokens)
            if new_block_ids is not None:
                return new_block_ids
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is request:
                return None

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Preempt by recompute: drop the KV; the request waits at its policy place (the front)."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # tokens in flight are dropped and sampled again later
        request.num_drafts_in_flight = 0
        request.spec_token_ids = []
        if request.structured_output_request is not None:
            self._forget_jumps(request.request_id)  # it comes back with every token it has
        self.num_preemptions_total += 1
        self.waiting.add(request)
        out.preempted_req_ids.add(request.request_id)

    def _schedule_waiting(self, out: SchedulerOutput) -> None:
        config = self.scheduler_config
        num_skipped = 0  # requests at the front whose grammar is still compiling: passed over
        # LoRA: the adapters of the running requests; a waiting request whose adapter would make
        # them more than max_loras is passed over (vLLM's rule), holding nothing.
        loras = self._running_loras() if config.max_loras is not None else None
        while len(self.waiting) > num_skipped and len(self.running) < config.max_num_seqs and self._budget_left(out) > 0:
            request = self.waiting[num_skipped]
            if self._in_flight is not None:
                if len(out.num_scheduled_tokens) >= self._micro_batch_cap:
                    break  # this micro-batch has its share: the next one admits the rest
                if request.request_id in self._in_flight:  # preempted while its step is in flight
                    num_skipped += 1
                    continue
            if loras is not None and request.lora_request is not None:
                lora_id = request.lora_request.lora_int_id
                if lora_id not in loras and len(loras) >= config.max_loras:
                    num_skipped += 1
                    continue
            grammar = request.structured_output_request
            if grammar is not None and (not grammar.is_ready() or grammar.failed):
                if grammar.failed:
                    self.waiting.remove(request)
                    self._abort_unschedulable(request)
                else:
                    num_skipped += 1
                continue
            hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_hit_tokens
            if self._can_never_run(request, num_new_tokens):
                self.waiting.remove(request)
                self._abort_unschedulable(request)
                continue
            if not config.enable_chunked_prefill and num_new_tokens > self._budget_left(out):
                break
            num_new_tokens = min(num_new_tokens, self._budget_left(out))
            new_block_ids = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, hit_blocks, num_hit_tokens
            )
            if new_block_ids is None:
                break  # no skipping ahead: the head waits for blocks, and so does everyone behind
            if num_skipped:
                self.waiting.remove(request)
            else:
                self.waiting.popleft()
            self._admit(request, num_hit_tokens, out)
            if loras is not None and request.lora_request is not None:
                loras.add(request.lora_request.lora_int_id)

    def _running_loras(self) -> set[int]:
        """The adapter ids of the running requests. Cost: O(running), only with LoRA on."""
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _can_never_run(self, request: Request, num_new_tokens: int) -> bool:
        if cdiv(request.num_tokens, self.block_size) > self.kv_cache_manager.num_blocks:
            return True
        config = self.scheduler_config
        return not config.enable_chunked_prefill and num_new_tokens > config.max_num_batched_tokens

    def _abort_unschedulable(self, request: Request, stop_reason: str | None = None) -> None:
        """Finish a request that left the waiting queue without running (it holds no blocks)."""
        request.status, request.stop_reason = RequestStatus.FINISHED_ABORTED, stop_reason
        self._release(request)
        self._pending_outputs.append(
            EngineCoreOutput(
                request.request_id, [], finish_reason=request.get_finish_reason(), stop_reason=stop_reason,
                num_cached_tokens=max(request.num_cached_tokens, 0),
            )
        )

    def _expire_timed_out(self, now: float) -> None:
        """Abort the requests that arrived more than ``timeout_s`` ago and were never scheduled.
        A held sibling is left alone (its first sequence runs: the group's wait is over); when a
        first sequence times out, its released siblings come next in the heap and time out too."""
        deadline = now - self.scheduler_config.timeout_s
        arrivals = self._arrivals
        while arrivals and arrivals[0][0] < deadline:
            _, number, req_id = heapq.heappop(arrivals)
            if self._insertion_number.get(req_id) != number:
                continue  # finished (the id may be in use by a later request)
            request = self.requests[req_id]
            if request.first_scheduled_time is not None:
                continue
            try:
                self.waiting.remove(request)
            except ValueError:
                continue  # a held sibling
            self._abort_unschedulable(request, QUEUE_TIMEOUT_REASON)

    def _admit(self, request: Request, num_hit_tokens: int, out: SchedulerOutput) -> None:
        """Start running ``request`` (its blocks are allocated) and schedule its tokens. Its
        CachedRequestData is not sent: the runner learns of it from the NewRequestData."""
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.time()
        self.running.add(request)
        out.scheduled_new_reqs.append(
            NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                num_computed_tokens=num_hit_tokens,
                pooling_params=request.pooling_params,
                lora_request=request.lora_request,
            )
        )
        self._schedule_tokens(out, [request], [])

    # -- results -------------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's results: append accepted tokens, stop, cache full blocks, free the finished.

        Returns one EngineCoreOutput per request that got tokens or prompt logprobs or finished.
        Cost: O(scheduled requests + sampled tokens + blocks that became full this step); the
        loop body is the per-request cost of every decode step, so it is kept flat.
        """
        outputs, self._pending_outputs = self._pending_outputs, []
        if self._in_flight is not None:
            self._in_flight.difference_update(scheduler_output.num_scheduled_tokens)
        if model_runner_output.pooler_output:
            outputs.extend(self._finish_pooled(model_runner_output.pooler_output))
        req_ids = list(scheduler_output.num_scheduled_tokens)
        rows: Iterable[int | None]
        if model_runner_output.req_ids == req_ids:
            rows = range(len(req_ids))  # the runner's rows are in scheduling order (the usual case)
        else:
            row = {req_id: i for i, req_id in enumerate(model_runner_output.req_ids)}
            rows = [row.get(req_id) for req_id in req_ids]
        requests = self.requests
        sampled_rows = model_runner_output.sampled_token_ids
        logprob_rows = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs
        if model_runner_output.draft_token_ids is not None:
            self._drafts_seen = True
        any_extras = bool(scheduler_output.scheduled_spec_decode_tokens or self._held_siblings or (
            self._num_with_stop_strings and self.stop_checker) or self._num_structured
        ) or model_runner_output.draft_token_ids is not None
        kv = self.kv_cache_manager
        num_cached_blocks = kv.num_cached_blocks if kv.enable_caching else None
        block_size = self.block_size
        max_model_len = self.scheduler_config.max_model_len
        superseded = self._superseded_samples
        for req_id, i in zip(req_ids, rows):
            request = requests.get(req_id)
            if request is None or request.status != _RUNNING:
                continue  # finished (aborted, stop string) or preempted while the step ran
            new_token_ids: list[int] = []
            finished = False
            if i is not None and (sampled := sampled_rows[i]) and not (superseded and self._drop_superseded(req_id)):
                request.num_output_placeholders -= 1
                # Append tokens one by one until a stop condition; tokens after a stop are dropped.
                output_ids, all_ids = request.output_token_ids, request.all_token_ids
                for token_id in sampled:
                    output_ids.append(token_id)
                    all_ids.append(token_id)
                    new_token_ids.append(token_id)
                    if token_id in request.stop_token_candidates and self._stop_on_token(request, token_id):
                        finished = True
                        break
                    if len(output_ids) >= request.max_tokens or len(all_ids) >= max_model_len:
                        request.status = _FINISHED_LENGTH
                        finished = True
                        break
                if any_extras:  # one test per request without drafts, stop strings or sibling groups
                    finished = self._settle_extras(
                        request, len(sampled), new_token_ids, finished, scheduler_output, model_runner_output
                    )
            if num_cached_blocks is not None:
                # Only tokens whose ids are known can be hashed into the prefix cache. Most steps
                # fill no block: this test (cache_blocks' own) then saves the call.
                num_known = request.num_computed_tokens
                if num_known > len(request.all_token_ids):
                    num_known = len(request.all_token_ids)
                num_cached = num_cached_blocks.get(req_id)
                if num_cached is not None and num_known // block_size > num_cached:
                    kv.cache_blocks(request, num_known)
            new_logprobs = None
            if i is not None and logprob_rows is not None:
                row_logprobs = logprob_rows[i]
                new_logprobs = row_logprobs[: len(new_token_ids)] if row_logprobs is not None else None
            new_prompt_logprobs = prompt_logprobs.get(req_id) if prompt_logprobs else None
            if new_token_ids or new_prompt_logprobs or finished:
                # A running request was given its num_cached_tokens (>= 0) when it was admitted.
                outputs.append(EngineCoreOutput(
                    req_id, new_token_ids, new_logprobs, new_prompt_logprobs,
                    request.get_finish_reason() if finished else None, request.stop_reason,
                    request.num_cached_tokens,
                ))
            if finished:
                self.running.remove(request)
                self._release(request)
        return outputs

    def _finish_pooled(self, pooler_output: dict[str, object]) -> list[EngineCoreOutput]:
        """Finish the pooling requests whose vectors came back ("stop"): their blocks are freed now
        (a pooled prompt's KV is never read again), so the loop after this skips them."""
        outputs = []
        for req_id, vector in pooler_output.items():
            request = self.requests.get(req_id)
            if request is None or request.status != _RUNNING:
                continue  # aborted while the step ran
            request.status, request.num_output_placeholders = _FINISHED_STOPPED, 0
            outputs.append(EngineCoreOutput(req_id, [], finish_reason="stop", num_cached_tokens=request.num_cached_tokens,
                                            pooling_output=vector))
            self.running.remove(request)
            self._release(request)
        return outputs

    def _settle_extras(
        self, request: Request, num_sampled: int, new_token_ids: list[int], finished: bool,
        scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput,
    ) -> bool:
        """The rest of applying a request's sampled tokens, for steps with drafts, stop strings or
        sibling groups: settle its scheduled drafts, check its stop strings, store its new drafts,
        queue the siblings it held back. Returns whether it is finished."""
        req_id = request.request_id
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
        if drafts:
            self._settle_drafts(request, len(drafts), num_sampled)
            self.spec_decoding_stats.observe(len(drafts), num_sampled - 1)
        if not finished and request.structured_output_request is not None:
            finished = self._advance_grammar(request, new_token_ids)  # may append jumped tokens
        if request.has_stop_strings and self.stop_checker is not None:
            finished = self._check_stop_strings(request, new_token_ids, finished) or finished
        if finished:
            return True
        # Drafts guess the tokens after the sampled one: none after a jump (tokens were appended).
        if model_runner_output.draft_token_ids is not None and len(new_token_ids) == num_sampled:
            request.spec_token_ids = model_runner_output.draft_token_ids.get(req_id) or []
        if req_id in self._held_siblings:
            self._queue_siblings(req_id)  # its prompt is computed (its full blocks are cached next)
        return False

    def _advance_grammar(self, request: Request, new_token_ids: list[int]) -> bool:
        """Advance the request's grammar by its new tokens; finish it (True) when the grammar has
        terminated (its stop token accepted: "stop", as EOS) or refused a token ("abort": the
        text could no longer match). Otherwise append the tokens the grammar forces next."""
        grammar = request.structured_output_request
        if not grammar.accept_tokens(new_token_ids):
            request.status = RequestStatus.FINISHED_ABORTED
            return True
        if grammar.is_terminated():
            request.status, request.stop_reason = _FINISHED_STOPPED, None
            return True
        # With drafts in flight, where the next token goes is not known yet: no jump this time.
        if grammar.may_jump and request.num_output_placeholders <= 1 and not request.num_drafts_in_flight:
            return self._jump_forward(request, new_token_ids)
        return False

    def _jump_forward(self, request: Request, new_token_ids: list[int]) -> bool:
        """Append the tokens the request's grammar forces (jump-forward; at most up to its length
        limits) to its output and to ``new_token_ids``; True if that finished it ("length")."""
        limit = min(request.max_tokens - len(request.output_token_ids),
                    self.scheduler_config.max_model_len - len(request.all_token_ids))
        token_ids = request.structured_output_request.jump_forward(limit)
        if not token_ids:
            return False
        req_id = request.request_id
        position = len(request.all_token_ids)
        request.output_token_ids.extend(token_ids)
        request.all_token_ids.extend(token_ids)
        new_token_ids.extend(token_ids)
        request.spec_token_ids = []
        if request.num_output_placeholders:  # async: the step in flight samples at `position`
            request.num_output_placeholders -= 1
            self._superseded_samples.add(req_id)
        unsent = self._jump_forward_tokens.get(req_id)
        if unsent is not None:
            unsent[1].extend(token_ids)
        else:
            self._jump_forward_tokens[req_id] = (position, list(token_ids))
        if len(token_ids) == limit:
            request.status = _FINISHED_LENGTH
            return True
        return False

    def _drop_superseded(self, req_id: str) -> bool:
        """Whether this result for ``req_id`` is a sample a jump superseded (then forgotten)."""
        if req_id in self._superseded_samples:
            self._superseded_samples.discard(req_id)
            return True
        return False

    @staticmethod
    def _settle_drafts(request: Request, num_drafts: int, num_sampled: int) -> None:
        """The step computed the request's last token and ``num_drafts`` drafts and returned
        ``num_sampled`` tokens: the first ``num_sampled - 1`` drafts were accepted. The rejected
        drafts' KV is not counted (their slots are overwritten later), and every placeholder of
        the step is settled."""
        num_rejected = num_drafts + 1 - num_sampled
        request.num_computed_tokens -= num_rejected
        request.num_output_placeholders -= num_drafts  # the caller took the sampled token's one
        request.num_drafts_in_flight = 0

    def _check_stop_strings(self, request: Request, new_token_ids: list[int], finished: bool) -> bool:
        """Ask the stop checker whether a stop string ends in this step's tokens; if so, keep the
        tokens up to the one that completes it and finish the request. Returns whether it did."""
        assert self.stop_checker is not None
        hit = self.stop_checker(request.request_id, new_token_ids, finished and request.status == _FINISHED_STOPPED)
        if hit is None:
            return False
        num_kept, stop_string = hit
        num_dropped = len(new_token_ids) - num_kept
        if num_dropped:
            del new_token_ids[num_kept:]
            del request.output_token_ids[-num_dropped:]
            del request.all_token_ids[-num_dropped:]
        request.status, request.stop_reason = _FINISHED_STOPPED, stop_string
        return True

    @staticmethod
    def _stop_on_token(request: Request, token_id: int) -> bool:
        """Whether ``token_id`` (just appended) stops the request: stop_token_ids, then EOS, both
        ignored below min_tokens. The length limits are checked after this (by the caller)."""
        params = request.sampling_params
        if request.num_output_tokens < params.min_tokens:
            return False
        if token_id in params.stop_token_ids:
            request.status, request.stop_reason = _FINISHED_STOPPED, token_id
            return True
        if not params.ignore_eos and token_id == request.eos_token_id:
            request.status, request.stop_reason = _FINISHED_STOPPED, None
            return True
        return False

    # -- introspection -------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + sum(map(len, self._held_siblings.values())),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions_total=self.num_preemptions_total,
            spec_decoding=self.spec_decoding_stats.copy() if self._drafts_seen else None,
        )

    def check_integrity(self) -> None:
        """Assert the scheduler's and the KV cache's invariants (for tests; O(requests + blocks))."""
        self.kv_cache_manager.check_integrity()
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        assert len(running_ids) == len(self.running) and len(waiting_ids) == len(self.waiting)
        assert not running_ids & waiting_ids, "a request is both running and waiting"
        held = [r for siblings in self._held_siblings.values() for r in siblings]
        held_ids = {r.request_id for r in held}
        assert all(self._held_siblings.values()), "an empty sibling group"
        assert len(held_ids) == len(held) and not held_ids & (running_ids | waiting_ids), "a sibling is held twice"
        assert running_ids | waiting_ids | held_ids == set(self.requests), "a request is lost or stale"
        assert set(self._held_siblings) <= set(self.requests), "siblings held by a finished request"
        assert len(self.running) <= self.scheduler_config.max_num_seqs
        if self.scheduler_config.max_loras is not None:
            assert len(self._running_loras()) <= self.scheduler_config.max_loras, "more adapters than max_loras"
        assert self.running.is_sorted() and self.waiting.is_sorted()
        assert set(self.kv_cache_manager.req_to_blocks) == running_ids, "blocks held outside running"
        for request in self.running:
            assert request.status == RequestStatus.RUNNING, request
            num_blocks = len(self.kv_cache_manager.req_to_blocks[request.request_id])
            assert num_blocks * self.block_size >= request.num_computed_tokens, request
            # A token in flight (async scheduling) may already be computed: it has a placeholder.
            assert request.num_computed_tokens <= request.num_tokens + request.num_output_placeholders, request
            # Drafts in flight came with their last token's placeholder; none wait while they fly.
            assert request.num_output_placeholders >= request.num_drafts_in_flight + bool(request.num_drafts_in_flight)
            assert not (request.num_drafts_in_flight and request.spec_token_ids), request
        for request in [*self.waiting, *held]:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request
            assert request.num_computed_tokens == 0, request
            assert not request.spec_token_ids and not request.num_drafts_in_flight, request
