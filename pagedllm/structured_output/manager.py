"""StructuredOutputManager: grammars for the engine core (compile pool, cache, per-step bitmask).

Flow of one constrained request:
1. ``LLMEngine.add_request`` -> ``prepare(params)``: a cache hit, or a parse (validation, raises
   ``ValueError`` naming the field) and a compile submitted to the thread pool. Nothing is kept
   for the request yet, so a refused request leaves no state anywhere.
2. ``EngineCore.add_request`` -> ``attach(request)``: the request gets its
   ``StructuredOutputRequest``; the scheduler keeps it waiting (others run) until ``is_ready()``.
3. Each step that samples for it: the scheduler's update gives its matcher the accepted tokens
   (``accept_tokens``: queued, except a stop token, which is accepted at once so that the
   request stops when the grammar terminates; with jump-forward on, it then appends the tokens
   the grammar forces: jump_forward.py). ``start_bitmask`` accepts the queued tokens of all the
   step's requests in one batched call split over helper threads (``_accept_pending``), then
   starts filling their bitmask rows on the fill thread; ``finish_bitmask`` waits for them
   (``grammar_bitmask`` does both; the engine core does its own work in between:
   engine_core.py), and the runner applies them to the logits.
4. The step after it finishes or is aborted (``SchedulerOutput.finished_req_ids``): ``release``.

Compiled grammars are cached by ``StructuredOutputsParams.cache_key()`` (kind, spec, options), so
one schema compiles once however many requests (or sequences of an n > 1 request) use it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sample.bitmask import GrammarOutput
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.jump_forward import JumpForward
from pagedllm.structured_output.request import StructuredOutputRequest

_RUNNING = RequestStatus.RUNNING


@dataclass
class BitmaskJob:
    """A step's bitmask being filled on the manager's fill thread (``start_bitmask``).
    ``future`` gives the fill's seconds; the rows are ``bitmask[:num_rows]``, ``req_ids`` in order."""

    req_ids: list[str]
    num_rows: int
    future: Future


@dataclass
class StructuredOutputStats:
    """The manager's counters at one moment (cumulative since the engine started), plus the compile
    times of the grammars compiled since the previous ``StructuredOutputManager.stats()`` call.
    Plain data: it crosses from the engine process to the front end inside each ``StepReport``."""

    num_compiled: int
    num_cache_hits: int
    new_compile_times_s: list[float]
    bitmask_time_s: float
    num_bitmask_steps: int
    num_jumped_tokens: int


class StructuredOutputManager:
    """Compiles grammars off the engine loop and fills the batched bitmask of each step.

    Invariant: ``_requests`` holds exactly the attached requests not yet released (each owns one
    matcher); ``_cache`` maps a constraint key to the future of its compiled grammar, and a key
    enters it only after its constraint parsed; at most ``max_cached_grammars`` keys are kept
    (least recently used dropped). Cost: ``prepare`` is a dict lookup on a hit, a parse (about a
    millisecond) on a miss; ``grammar_bitmask`` is O(structured requests of the step) matcher
    calls into one reused int32 buffer, the fills batched into one multi-threaded call on the fill
    thread (one fill in flight at a time: the engine core finishes a job before it starts another).

    Counters (the engine's metrics read them): ``num_compiled``, ``compile_time_s`` (summed;
    ``take_compile_times`` gives each), ``num_cache_hits`` (requests whose constraint was already
    compiled or compiling), ``bitmask_time_s`` and ``num_bitmask_steps`` (time spent filling
    bitmasks, over the steps that had structured requests: their ratio is the time per step),
    ``bitmask_wait_s`` (the part of it the engine thread waited for: the rest overlapped its work),
    ``num_jumped_tokens`` (tokens appended by jump-forward).

    ``jump_forward``: requests that ask for no logprobs get the shared ``JumpForward``
    (jump_forward.py), and the scheduler appends the tokens their grammar forces.
    """

    def __init__(self, tokenizer, vocab_size: int, max_compile_threads: int = 2, max_cached_grammars: int = 512,
                 jump_forward: bool = False) -> None:
        self._tokenizer = tokenizer
        self.jump_forward_enabled = jump_forward
        self._jump_forward: JumpForward | None = None  # built on the first request that may jump
        self._backend = None  # built on the first constraint: importing xgrammar takes a while
        self.vocab_size = vocab_size
        self._pool: ThreadPoolExecutor | None = None  # started on the first constraint
        self._fill_thread: ThreadPoolExecutor | None = None  # one worker: the bitmask fills, in order
        self._max_compile_threads = max_compile_threads
        # Least recently used first; requests hold their own future, so evicting one is safe.
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._max_cached_grammars = max_cached_grammars
        self._counter_lock = threading.Lock()  # the compile threads update the counters
        self._requests: dict[str, StructuredOutputRequest] = {}
        self._bitmask = np.zeros((0, (vocab_size + 31) // 32), dtype=np.int32)
        self.num_compiled = 0
        self.compile_time_s = 0.0
        self._new_compile_times_s: list[float] = []  # since the last take_compile_times()
        self.num_cache_hits = 0
        self.bitmask_time_s = 0.0
        self.bitmask_wait_s = 0.0
        self.accept_time_s = 0.0  # the engine thread's time accepting the steps' pending tokens
        # Experimental (off): the step's single pending tokens are accepted on the fill thread,
        # right before its fill, instead of on the engine thread (benchmarks/gpu/structured_output_bench.py
        # --ab measures both); ``_fill_accepts`` hands them from start_bitmask to that thread.
        self.accepts_on_fill_thread = False
        self._fill_accepts: tuple | None = None
        self.num_bitmask_steps = 0

    @property
    def backend(self):
        """The xgrammar backend (``backend.XgrammarBackend``), built on first use."""
        if self._backend is None:
            from pagedllm.structured_output.backend import XgrammarBackend

            self._backend = XgrammarBackend(self._tokenizer, self.vocab_size, self._max_compile_threads)
        return self._backend

    # -- requests in and out -------------------------------------------------------------------
    def prepare(self, params: StructuredOutputsParams) -> None:
        """Validate ``params`` (``ValueError`` naming the field) and start compiling it unless a
        request before it did."""
        key = params.cache_key()
        if key in self._cache:
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
            return
        grammar = self.backend.parse(params)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_compile_threads, thread_name_prefix="pagedllm-grammar")
        self._cache[key] = self._pool.submit(self._compile, grammar)
        if len(self._cache) > self._max_cached_grammars:
            self._cache.popitem(last=False)

    def _compile(self, grammar):
        t0 = time.perf_counter()
        compiled = self.backend.compile(grammar)
        elapsed = time.perf_counter() - t0
        with self._counter_lock:
            self.num_compiled += 1
            self.compile_time_s += elapsed
            self._new_compile_times_s.append(elapsed)
        return compiled

    def take_compile_times(self) -> list[float]:
        """The compile times (seconds) of the grammars compiled since the previous call (the
        samples of a histogram)."""
        with self._counter_lock:
            times, self._new_compile_times_s = self._new_compile_times_s, []
        return times

    def stats(self) -> StructuredOutputStats:
        """The counters now, and the compile times since the previous call (the engine's metrics
        take one per step: a histogram sample per compile)."""
        times = self.take_compile_times()
        return StructuredOutputStats(self.num_compiled, self.num_cache_hits, times, self.bitmask_time_s,
                                     self.num_bitmask_steps, self.num_jumped_tokens)

    def attach(self, request: Request) -> None:
        """Give ``request`` (whose constraint went through ``prepare``) its grammar state."""
        params = request.sampling_params.structured_outputs
        key = params.cache_key()
        if key not in self._cache:  # skipped prepare(), or evicted since: validate and compile here
            self.prepare(params)
        # The grammar's end admits the request's stop tokens (EOS unless ignore_eos, and its
        # stop_token_ids); with none, the tokenizer's EOS.
        stop = sorted(request.stop_token_candidates) or None
        state = StructuredOutputRequest(self._cache[key], stop, self.backend.new_matcher, self._jump_forward_for(request))
        request.structured_output_request = state
        self._requests[request.request_id] = state

    def _jump_forward_for(self, request: Request) -> JumpForward | None:
        """The shared ``JumpForward`` if ``request`` may jump: jump-forward is on and it asks for no
        logprobs (a jumped token has none: jump_forward.py)."""
        if not self.jump_forward_enabled or request.sampling_params.logprobs is not None:
            return None
        if self._jump_forward is None:
            self._jump_forward = self.backend.new_jump_forward()
        return self._jump_forward

    @property
    def num_jumped_tokens(self) -> int:
        """Tokens appended by jump-forward (not sampled) so far."""
        return self._jump_forward.num_jumped_tokens if self._jump_forward is not None else 0

    def release(self, req_ids: set[str]) -> None:
        """Drop the grammar state of finished or aborted requests (their matchers)."""
        for req_id in req_ids:
            self._requests.pop(req_id, None)

    @property
    def num_requests(self) -> int:
        """Attached requests not yet released (each holds a matcher once scheduled)."""
        return len(self._requests)

    def wait_for_compile(self, timeout_s: float) -> None:
        """Block until one attached request's grammar is compiled, or ``timeout_s`` passes
        (returns at once when none is compiling). O(attached requests)."""
        compiling = [state.compiled for state in self._requests.values() if not state.is_ready()]
        if compiling:
            wait(compiling, timeout=timeout_s, return_when=FIRST_COMPLETED)

    # -- one step ------------------------------------------------------------------------------
    def has_requests_in(self, scheduler_output: SchedulerOutput) -> bool:
        live = self._requests
        return bool(live) and any(req_id in live for req_id in scheduler_output.num_scheduled_tokens)

    def grammar_bitmask(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> GrammarOutput | None:
        """The bitmask rows of the step's structured requests that sample in it, filled before
        returning (``start_bitmask`` then ``finish_bitmask``), or None if there are none."""
        job = self.start_bitmask(scheduler_output, requests)
        return self.finish_bitmask(job) if job is not None else None

    def start_bitmask(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> BitmaskJob | None:
        """Choose the rows of the step's structured requests that sample in it (their matchers have
        accepted every token before the step) and start filling them on the fill thread; None if
        there are none. Until ``finish_bitmask(job)`` the chosen requests' matchers belong to the
        fill thread: the caller may schedule, add and abort requests, not advance those matchers.

        A request samples in the step iff it still has placeholders once the previous step's
        tokens are applied (1 + its drafts); a partial prefill has none."""
        t0 = time.perf_counter()
        scheduled = scheduler_output.num_scheduled_tokens
        drafts_of = scheduler_output.scheduled_spec_decode_tokens
        max_rows = len(scheduled) + (sum(map(len, drafts_of.values())) if drafts_of else 0)
        if self._bitmask.shape[0] < max_rows:
            self._bitmask = np.zeros((max(max_rows, 2 * self._bitmask.shape[0]), self._bitmask.shape[1]), np.int32)
        bitmask = self._bitmask
        req_ids: list[str] = []
        states, rows = [], []  # the rows to fill, once the pending tokens are accepted
        num_rows = 0
        live = self._requests
        for req_id in scheduled:
            state = live.get(req_id)
            if state is None:
                continue
            request = requests.get(req_id)
            if request is None or request.status != _RUNNING or not request.num_output_placeholders:
                continue
            req_ids.append(req_id)
            drafts = drafts_of.get(req_id) if drafts_of else None
            if drafts:  # rare (speculative decoding): walked here, on this thread
                state.fill_bitmask(bitmask, num_rows, drafts)
                num_rows += len(drafts) + 1
                continue
            if state.is_terminated():
                bitmask[num_rows] = -1
            else:
                states.append(state)
                rows.append(num_rows)
            num_rows += 1
        if not req_ids:
            return None
        matchers, rows = self._accept_pending(states, rows, bitmask)
        self.bitmask_time_s += time.perf_counter() - t0  # choosing the rows, accepting, walking the drafts
        if not matchers:  # every row already written (terminated grammars, drafts)
            assert self._fill_accepts is None  # a matcher given tokens is one to fill
            future: Future = Future()
            future.set_result(0.0)
            return BitmaskJob(req_ids, num_rows, future)
        if self._fill_thread is None:
            self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-bitmask")
        started = threading.Event()
        future = self._fill_thread.submit(self._fill_rows, matchers, rows, started)
        # Hand the GIL to the fill thread until it is inside xgrammar (which releases it): left to
        # the interpreter, a thread waiting for the GIL gets it only after the switch interval.
        started.wait()
        return BitmaskJob(req_ids, num_rows, future)

    def _accept_pending(self, states: list[StructuredOutputRequest], rows: list[int],
                        bitmask: np.ndarray) -> tuple[list, list[int]]:
        """Give each state's pending tokens to its matcher: the single tokens of all of them in
        one batched accept split over the accept threads (``XgrammarBackend.batch_accept``),
        longer runs one by one. Returns the matchers to fill and their rows; a refusing one's row
        allows everything (the scheduler aborts the request at its next update)."""
        t0 = time.perf_counter()
        matchers, singles, tokens = [], [], []
        any_refused = False
        for k, state in enumerate(states):
            matcher, pending = state.take_pending()
            matchers.append(matcher)
            if len(pending) == 1:
                singles.append(k)
                tokens.append(pending[0])
            elif pending:  # after a jump or a draft: rare
                state.accept_now(pending)
                any_refused = any_refused or state.refused
        if singles and self.accepts_on_fill_thread:
            self._fill_accepts = ([states[k] for k in singles], [matchers[k] for k in singles], tokens)
        elif singles:
            for j in self.backend.batch_accept([matchers[k] for k in singles], tokens):
                states[singles[j]].refuse(tokens[j])
                any_refused = True
        self.accept_time_s += time.perf_counter() - t0
        if not any_refused:
            return matchers, rows
        keep = []
        for k, (state, row) in enumerate(zip(states, rows)):
            if state.refused:
                bitmask[row] = -1
            else:
                keep.append(k)
        return [matchers[k] for k in keep], [rows[k] for k in keep]

    def finish_bitmask(self, job: BitmaskJob) -> GrammarOutput:
        """Wait for ``job``'s fill; its rows, in the order of ``job.req_ids``."""
        t0 = time.perf_counter()
        self.bitmask_time_s += job.future.result()  # re-raises the fill's error, if any
        self.bitmask_wait_s += time.perf_counter() - t0
        self.num_bitmask_steps += 1
        # The runner copies the rows before sample_tokens returns, so the buffer is reused next step.
        return GrammarOutput(job.req_ids, self._bitmask[:job.num_rows])

    def _fill_rows(self, matchers: list, rows: list[int], started: threading.Event) -> float:
        """Fill ``bitmask[rows[i]]`` from ``matchers[i]`` (on the fill thread); returns the seconds
        it took. One batched xgrammar call on its own threads, outside the GIL: the fill is the
        step's largest CPU cost (tens of microseconds per request for a JSON schema), so the
        engine thread does other work meanwhile."""
        t0 = time.perf_counter()
        accepts, self._fill_accepts = self._fill_accepts, None
        started.set()
        if accepts is not None:  # accepts_on_fill_thread: one call here, before the fill
            states, accepting, tokens = accepts
            for j in self.backend.batch_accept(accepting, tokens, helpers=False):
                states[j].refuse(tokens[j])  # its row is filled before the token: the request aborts
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(self._bitmask, rows[0])
        else:
            self.backend.batch_fill_bitmask(matchers, self._bitmask, rows)
        return time.perf_counter() - t0

    def shutdown(self) -> None:
        for pool in (self._pool, self._fill_thread):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if self._backend is not None:
            self._backend.shutdown()
