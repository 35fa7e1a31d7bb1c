"""EngineCore: the loop body. step() = schedule -> execute -> sample -> update_from_output.

Owns the scheduler (pure Python) and an executor (the workers, which own the tensors); the only
things crossing between them are SchedulerOutput and ModelRunnerOutput (DESIGN rule 2).

With async scheduling (the default on CUDA) one step is kept in flight: step() schedules and
launches step N, then waits for step N-1's tokens and applies them. The CPU work of a step
(scheduling, input preparation, output processing) thus overlaps the GPU's work on the previous
one; the scheduler counts each in-flight sampled token as a placeholder so that step N can
already compute it, and the runner feeds its id to step N on the GPU.

Structured output: a step with constrained requests samples with their bitmask, and the bitmask
needs every earlier token accepted by the matchers: sample(N-1) -> accept(N-1) -> fill(N) ->
sample(N) is a chain no order can shorten. What the order decides is what runs beside it.
Without async scheduling a step is serial: execute(N) -> fill(N) -> sample(N) -> wait -> apply(N).
With it, a constrained step N runs

    schedule(N) -> sample(N-1) -> execute(N) -> wait(N-1) -> apply(N-1) -> start fill(N) -> return

and the next step samples N before it executes N+1. The fill runs on the manager's fill thread
(xgrammar's batched fill, outside the GIL, on its own threads) while the engine thread returns,
the outputs of N-1 are processed and N+1 is scheduled, and while the GPU runs forward N. The next
step then waits for what is left of the fill, samples N and launches forward N+1 right behind
it, so the GPU computes N+1 while the engine thread applies N. Against the unconstrained order
the engine thread adds only the matchers' accepts (batched, split over helper threads, at the
start of the fill), the choice of the rows, and the part of the fill that outlasts output
processing plus scheduling
(``StructuredOutputManager.bitmask_wait_s``). ``_unsampled`` holds the step between its fill's
start and its sample; the runner never sees the difference (execute and sample still alternate).
A step without constrained requests keeps the plain order (no cost).
``benchmarks/structured_step_overhead.py`` measures the cost against a simulated GPU.

Pipeline parallel (``pipeline_parallel_size`` = P > 1) replaces that order with a batch queue (vLLM's
``step_with_batch_queue``): up to P micro-batches of disjoint requests are in flight, so that stage
s works on one while stage s + 1 works on the one before it. A step schedules and launches one
micro-batch and returns at once while the queue has room and the scheduler found work; otherwise
(queue full, or nothing left to schedule) it waits for the oldest micro-batch and applies it. A
request is scheduled again only once its micro-batch is applied, so its tokens are all known here
and travel with the next step that computes them (``SchedulerOutput.new_token_ids``): the stages
before the last never wait for the last one's samples. A constrained micro-batch fills its bitmask
before it samples (its requests' matchers are up to date: their last step was applied).
``benchmarks/pp_microbatch.py`` measures the gain on the CPU.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
import weakref
from collections import deque
from collections.abc import Sequence

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler, StopChecker
from pagedllm.executor import executor_class
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.structured_output.manager import BitmaskJob

logger = logging.getLogger("pagedllm")


class EngineCore:
    """The scheduler and the executor, stepped together.

    Invariant: with async scheduling at most one launched step is not yet applied to the
    scheduler: sampled (``_in_flight``), or waiting for its bitmask (``_unsampled``, structured
    output: its forward is launched, its sample is the first thing the next step launches);
    without it none. With pipeline parallelism instead (``_batch_queue``) at most
    ``max_micro_batches`` launched steps are not yet applied, over disjoint requests, and they are
    applied in launch order. Cost per step: one schedule, one executor launch,
    one wait for a step's tokens and one ``update_from_output``, all O(scheduled requests).
    ``stop_checker`` (the engine's stop-string check) is handed to the scheduler's update.
    ``structured_output`` (built from ``tokenizer``; None without one) owns the grammars.
    """

    # Async structured output: (SchedulerOutput, BitmaskJob) of a step whose forward is launched and
    # whose bitmask is being filled; the next step samples it first (module doc). A class default
    # so that engines built without __init__ (benchmarks' fake cores) start without one.
    _unsampled: tuple[SchedulerOutput, BitmaskJob] | None = None
    # Pipeline parallel: the launched micro-batches not yet applied, oldest first (module doc);
    # None without pipeline parallelism.
    _batch_queue: deque | None = None

    def __init__(self, config: EngineConfig, stop_checker: StopChecker | None = None, tokenizer=None) -> None:
        t0 = time.perf_counter()
        self.executor = executor_class(config)(config)
        num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_kv_cache(num_blocks)
        cache_config = dataclasses.replace(config.cache_config, num_blocks=num_blocks)
        self.config = config
        self.cache_config = cache_config
        self.scheduler = Scheduler(config.scheduler_config, cache_config, stop_checker)
        self.structured_output = (
            StructuredOutputManager(tokenizer, config.model_config.vocab_size,
                                    jump_forward=config.structured_outputs_config.jump_forward)
            if tokenizer is not None else None
        )
        self.executor.warm_up()
        # Everything built so far (modules, imports, tables) lives as long as the engine: move it out
        # of the garbage collector's sight, or each full collection while serving scans every one
        # of them (a stall of the step loop). Frozen objects are
        # never collected, so when this engine is dropped the frozen set goes back to the collector:
        # the cycles among start-up objects (scheduler <-> its queues, the free-block list) are then
        # freed by the next collection instead of living as long as the process.
        gc.collect()
        gc.freeze()
        weakref.finalize(self, gc.unfreeze)
        self.async_scheduling = config.async_scheduling
        self._in_flight = None  # (SchedulerOutput, StepHandle) of the step still on the GPU
        # Cumulative wall time per phase (seconds), for profiling the CPU share of a step.
        self.step_timings: dict[str, float] = {"schedule": 0.0, "execute": 0.0, "update": 0.0, "steps": 0}
        if config.parallel_config.pipeline_parallel_size > 1:
            self.set_max_micro_batches(config.parallel_config.pipeline_parallel_size)
        logger.info(
            "engine ready in %.1f s: %d KV blocks of %d tokens (%d tokens, %.2f GiB) on %s",
            time.perf_counter() - t0, num_blocks, cache_config.block_size, num_blocks * cache_config.block_size,
            num_blocks * self.executor.bytes_per_block() / 2**30, config.device,
        )

    @property
    def runner(self):
        """The model runner of an in-process executor (benchmarks and tests inspect it)."""
        worker = getattr(self.executor, "worker", None)
        if worker is None:
            raise ValueError("distributed_executor_backend: the model runner is in this process only with 'uni' "
                             "(one rank); with worker processes it cannot be inspected from here")
        return worker.model_runner

    def prepare_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Validate a request's constraint (``ValueError`` naming the field) and start compiling it;
        called before the request is registered anywhere, so a refusal leaves nothing behind."""
        self._grammars().prepare(params)

    def _grammars(self) -> StructuredOutputManager:
        if self.structured_output is None:
            raise ValueError("structured_outputs needs a tokenizer (the engine was started with skip_tokenizer_init)")
        return self.structured_output

    def add_request(self, request: Request, siblings: Sequence[Request] = ()) -> None:
        if request.sampling_params.structured_outputs is not None:
            grammars = self._grammars()
            for r in (request, *siblings):
                grammars.attach(r)  # validates here too if the caller did not prepare it
        self.scheduler.add_request(request, siblings)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def set_max_micro_batches(self, depth: int) -> None:
        """Pipeline parallel: keep up to ``depth`` micro-batches in flight (module doc; the
        engine starts with ``pipeline_parallel_size``; 1 runs one batch at a time, for comparison).
        ``micro_batch_stats`` counts the micro-batches launched and how many were in flight."""
        if self._batch_queue:
            raise RuntimeError("set_max_micro_batches while micro-batches are in flight")
        self._batch_queue = deque()
        self.max_micro_batches = depth
        self.micro_batch_stats = {"launched": 0, "launched_behind_another": 0, "max_in_flight": 0}
        self.scheduler.schedule_micro_batches(depth)

    def step(self) -> list[EngineCoreOutput]:
        """schedule -> execute -> update. The scheduler is always told the outcome, even of an empty
        step, so requests it finished on its own (can never fit) are reported."""
        if self._batch_queue is not None:
            return self._step_with_batch_queue()
        t0 = time.perf_counter()
        sched_out = self.scheduler.schedule()
        t1 = time.perf_counter()
        grammars = self.structured_output
        if grammars is not None and grammars.num_requests:
            grammars.release(sched_out.finished_req_ids)
        if self._unsampled is not None:
            self._sample_unsampled()  # before the next forward: the runner samples in launch order
        self.executor.execute_model(sched_out)
        if grammars is not None and grammars.num_requests:
            if grammars.has_requests_in(sched_out):
                return self._step_with_grammar(sched_out, t0, t1)
            if sched_out.is_empty and (self._in_flight is None or self._in_flight[0].is_empty):
                # Nothing to run but grammars to compile: wait for one rather than spin the loop
                # (a spinning loop takes the CPU, and the GIL, from the compile threads).
                grammars.wait_for_compile(timeout_s=0.01)
        handle = self.executor.sample_tokens()
        if self.async_scheduling:
            (done_out, done_handle), self._in_flight = self._in_flight or (None, None), (sched_out, handle)
        else:
            done_out, done_handle = sched_out, handle
        if done_handle is None:  # first async step: nothing back from the GPU yet
            done_out, runner_out = SchedulerOutput(), ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        else:
            runner_out = done_handle.result()
        t2 = time.perf_counter()
        outputs = self.scheduler.update_from_output(done_out, runner_out)
        self._add_timings(t0, t1, t2, time.perf_counter())
        return outputs

    def _step_with_grammar(self, sched_out: SchedulerOutput, t0: float, t1: float) -> list[EngineCoreOutput]:
        """The rest of a step with constrained requests (module doc). Async: apply the step in
        flight, so that the matchers have accepted its tokens, start filling this step's bitmask on
        the fill thread and return; the next step samples this one once the fill is done.
        Without async scheduling: fill, sample, wait, apply."""
        grammars = self.structured_output
        if not self.async_scheduling:
            handle = self.executor.sample_tokens(grammars.grammar_bitmask(sched_out, self.scheduler.requests))
            runner_out = handle.result()
            t2 = time.perf_counter()
            outputs = self.scheduler.update_from_output(sched_out, runner_out)
            self._add_timings(t0, t1, t2, time.perf_counter())
            return outputs
        done_out, done_handle = self._in_flight or (SchedulerOutput(), None)
        self._in_flight = None
        runner_out = done_handle.result() if done_handle is not None else ModelRunnerOutput([], [])
        t2 = time.perf_counter()
        outputs = self.scheduler.update_from_output(done_out, runner_out)
        job = grammars.start_bitmask(sched_out, self.scheduler.requests)
        if job is None:  # no constrained request samples in this step (partial prefills)
            self._in_flight = (sched_out, self.executor.sample_tokens())
        else:
            self._unsampled = (sched_out, job)
        self._add_timings(t0, t1, t2, time.perf_counter())
        return outputs

    def _sample_unsampled(self) -> None:
        """Sample the step whose bitmask was being filled (it becomes the step in flight)."""
        sched_out, job = self._unsampled
        self._unsampled = None
        self._in_flight = (sched_out, self.executor.sample_tokens(self.structured_output.finish_bitmask(job)))

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """One step of pipeline parallelism (module doc): launch a micro-batch while the queue has
        room and there is work, else wait for the oldest one and apply it."""
        t0 = time.perf_counter()
        queue, outputs = self._batch_queue, []
        launched = False
        if len(queue) < self.max_micro_batches:
            sched_out = self.scheduler.schedule()
            if sched_out.is_empty and not (sched_out.finished_req_ids or sched_out.preempted_req_ids):
                # Nothing for the workers: report what the scheduler finished on its own, if anything.
                outputs = self.scheduler.update_from_output(sched_out, ModelRunnerOutput([], []))
                self._wait_for_grammars_if_idle()
            else:
                self._launch_micro_batch(sched_out)
                launched = not sched_out.is_empty
        t1 = time.perf_counter()
        if queue and (not launched or len(queue) == self.max_micro_batches):
            done_out, handle = queue.popleft()
            runner_out = handle.result()
            t2 = time.perf_counter()
            outputs += self.scheduler.update_from_output(done_out, runner_out)
            self._add_timings(t0, t1, t2, time.perf_counter())
        return outputs

    def _launch_micro_batch(self, sched_out: SchedulerOutput) -> None:
        grammars = self.structured_output
        bitmask = None
        if grammars is not None and grammars.num_requests:
            grammars.release(sched_out.finished_req_ids)
        self.executor.execute_model(sched_out)
        if grammars is not None and grammars.num_requests and grammars.has_requests_in(sched_out):
            bitmask = grammars.grammar_bitmask(sched_out, self.scheduler.requests)
        queue = self._batch_queue
        queue.append((sched_out, self.executor.sample_tokens(bitmask)))
        if not sched_out.is_empty:
            stats = self.micro_batch_stats
            in_flight = sum(not so.is_empty for so, _ in queue)
            stats["launched"] += 1
            stats["launched_behind_another"] += in_flight > 1
            stats["max_in_flight"] = max(stats["max_in_flight"], in_flight)

    def _wait_for_grammars_if_idle(self) -> None:
        """Nothing to run but grammars to compile: wait for one rather than spin the loop."""
        grammars = self.structured_output
        if not self._batch_queue and grammars is not None and grammars.num_requests:
            grammars.wait_for_compile(timeout_s=0.01)

    def _add_timings(self, t0: float, t1: float, t2: float, t3: float) -> None:
        timings = self.step_timings
        timings["schedule"] += t1 - t0
        timings["execute"] += t2 - t1
        timings["update"] += t3 - t2
        timings["steps"] += 1

    def has_unfinished_requests(self) -> bool:
        if self.scheduler.has_unfinished_requests():  # the usual answer, checked first (every step)
            return True
        in_flight = self._in_flight is not None and not self._in_flight[0].is_empty
        return (in_flight or self._unsampled is not None or bool(self._batch_queue)
                or self.scheduler.has_finished_requests())

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def shutdown(self) -> None:
        if self.structured_output is not None:
            self.structured_output.shutdown()
        self.executor.shutdown()
