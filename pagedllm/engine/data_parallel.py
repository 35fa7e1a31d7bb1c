"""Data parallel: N engine cores (one process each, each with its own TP x PP workers) behind one
front end (``AsyncLLMEngine``), as vLLM's ``data_parallel_size``.

``DataParallelEngines`` stands where one ``EngineProcess`` would: the front end sends it commands and
gets events, unaware of the replicas.

- Routing: a new request goes to the core with the least load, ``4 x waiting + running`` sequences
  (vLLM's weights: a waiting sequence delays everything behind it), from the counts each core
  reported with its last step plus the sequences sent to it since. Ties go round-robin. A request
  id that is live on a core goes to that core again, so that the core refuses the duplicate as a
  single engine would.
- Aborts go to the core holding the request (an abort by bare id to every core that holds it).
- Events of all cores reach the front end one at a time (one lock), as from a single engine; each
  step report carries the scheduler stats merged over the cores' latest reports (counts and
  cumulative counters summed, KV-cache usage averaged), so the front end's metrics and admission
  control see the whole server.
- Failure: a core that dies (or whose loop crashes) ends the whole engine at once: the front end
  gets ``LoopEnded`` naming the core, and the other cores are stopped. A stop ends the engine when
  every core has ended.

Invariant: ``_add_core`` maps every add sent and not yet over (refused, finished, failed) to its
core; ``_live`` maps each request id live on a core to the add that created it. Cost: O(cores) per
new request and per step report, on top of the cores' own.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import SchedulerStats, SpecDecodingStats
from pagedllm.engine.engine_loop import (
    AbortCommand,
    AddCommand,
    Command,
    Event,
    LoopEnded,
    Refused,
    StepFailed,
    StepReport,
)
from pagedllm.engine.engine_proc import EngineProcess, EngineProcessError
from pagedllm.executor.mp_worker import first_device_index

logger = logging.getLogger("pagedllm")

_WAITING_WEIGHT = 4


def replica_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config of data-parallel replica ``rank``: one engine core (``data_parallel_size`` 1) on
    its own GPUs, ``cuda:K + rank x world_size`` onwards (the CPU is shared)."""
    pc = config.parallel_config
    device = config.device
    if device.startswith("cuda"):
        device = f"cuda:{first_device_index(config) + rank * pc.world_size}"
    return dataclasses.replace(config, device=device,
                               parallel_config=dataclasses.replace(pc, data_parallel_size=1))


@dataclasses.dataclass
class _CoreLoad:
    """What one core holds, as far as the front end knows: its last report's counts plus the
    sequences sent since (not yet in a report)."""

    waiting: int = 0
    running: int = 0
    sent_since_report: int = 0

    def score(self) -> int:
        return _WAITING_WEIGHT * (self.waiting + self.sent_since_report) + self.running


class DataParallelEngines:
    """``data_parallel_size`` engine processes behind one ``on_event`` (module doc). Construction
    returns once every core is ready, or raises the first start-up error (having stopped the rest)."""

    def __init__(self, config: EngineConfig, on_event: Callable[[Event], None], idle_poll_s: float = 0.5) -> None:
        size = config.parallel_config.data_parallel_size
        self._on_event = on_event
        self._lock = threading.Lock()
        self._loads = [_CoreLoad() for _ in range(size)]
        self._stats: list[SchedulerStats | None] = [None] * size
        self._structured: list = [None] * size
        self._ended = [False] * size
        self._dead = False
        self._add_core: dict[int, int] = {}
        self._live: dict[str, int] = {}
        self._tie_break = itertools.count()
        self.cores: list[EngineProcess | None] = [None] * size

        def start(rank: int) -> EngineProcess:
            core = EngineProcess(replica_config(config, rank), lambda e: self._on_core_event(rank, e), idle_poll_s,
                                 num_processes=size)
            self.cores[rank] = core
            return core

        with ThreadPoolExecutor(max_workers=size, thread_name_prefix="pagedllm-dp-start") as pool:
            futures = [pool.submit(start, rank) for rank in range(size)]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if not errors and self._dead:  # a core that was ready died while another was starting
            errors = [EngineProcessError("a data-parallel engine core died during start-up")]
        if errors:
            self._shutdown_cores(timeout_s=5.0)
            raise errors[0]

    # -- commands -----------------------------------------------------------------------------
    def send(self, command: Command) -> None:
        """Route ``command``; the pipe writes happen outside the lock (a core blocked on its event
        pipe must never wait for a sender that holds it)."""
        with self._lock:
            targets = self._route(command)
        for rank in targets:
            core = self.cores[rank]
            if core is not None:
                core.send(command)

    def _route(self, command: Command) -> list[int]:
        if isinstance(command, AddCommand):
            rank = self._core_for(command.request_id)
            seqs = max(1, int(getattr(command.params, "n", 1) or 1))
            self._add_core[command.add_id] = rank
            self._live.setdefault(command.request_id, command.add_id)
            self._loads[rank].sent_since_report += seqs
            return [rank]
        if isinstance(command, AbortCommand):
            if command.add_id is not None:
                rank = self._add_core.get(command.add_id)
                return [] if rank is None else [rank]
            ranks = {self._add_core.get(self._live.get(rid, -1)) for rid in command.request_ids}
            return sorted(r for r in ranks if r is not None)
        return list(range(len(self.cores)))  # stop: every core

    def _core_for(self, request_id: str) -> int:
        add_id = self._live.get(request_id)
        if add_id is not None and add_id in self._add_core:
            return self._add_core[add_id]
        scores = [load.score() for load in self._loads]
        best = min(scores)
        candidates = [rank for rank, score in enumerate(scores) if score == best]
        return candidates[next(self._tie_break) % len(candidates)]

    # -- events -------------------------------------------------------------------------------
    def _on_core_event(self, rank: int, event: Event) -> None:
        with self._lock:
            forward = self._account(rank, event)
            if forward is not None:
                self._on_event(forward)

    def _account(self, rank: int, event: Event) -> Event | None:
        """Update the routing state for ``event`` of core ``rank``; the event to forward, or None
        (nothing once the engine has ended: the front end has failed every request already)."""
        if self._dead:
            return None
        if isinstance(event, Refused):
            self._forget_add(event.add_id)
        elif isinstance(event, StepReport):
            return self._merged_report(rank, event)
        elif isinstance(event, StepFailed):
            for rid in event.request_ids:
                self._forget_request(rid)
        elif isinstance(event, LoopEnded):
            return self._core_ended(rank, event)
        return event  # Accepted: nothing to track

    def _merged_report(self, rank: int, report: StepReport) -> StepReport:
        stats = report.scheduler_stats
        self._stats[rank] = stats
        self._loads[rank] = _CoreLoad(stats.num_waiting, stats.num_running)
        for out in report.outputs:
            if out.finished:
                self._forget_request(out.request_id)
        structured = report.structured_output_stats
        if structured is not None:
            self._structured[rank] = structured
            structured = merge_structured_output_stats(structured, [s for s in self._structured if s is not None])
        merged = merge_scheduler_stats([s for s in self._stats if s is not None])
        return dataclasses.replace(report, scheduler_stats=merged, structured_output_stats=structured)

    def _core_ended(self, rank: int, event: LoopEnded) -> LoopEnded | None:
        self._ended[rank] = True
        for add_id in [a for a, r in self._add_core.items() if r == rank]:
            self._forget_add(add_id)
        if event.error is not None:
            self._dead = True
            core = self.cores[rank]
            pid = core.pid if core is not None else None
            logger.error("data-parallel engine core %d died: stopping the other cores", rank)
            threading.Thread(target=self._shutdown_cores, args=(5.0,), name="pagedllm-dp-stop", daemon=True).start()
            return LoopEnded(f"data-parallel engine core {rank} (pid {pid}): {event.error}")
        if all(self._ended):
            self._dead = True
            return LoopEnded(None)
        return None

    def _forget_add(self, add_id: int) -> None:
        """An add is over without a finished output (refused, or its core ended)."""
        if self._add_core.pop(add_id, None) is None:
            return
        for rid in [r for r, a in self._live.items() if a == add_id]:
            del self._live[rid]

    def _forget_request(self, request_id: str) -> None:
        add_id = self._live.pop(request_id, None)
        if add_id is not None:
            self._add_core.pop(add_id, None)

    # -- the backend interface ----------------------------------------------------------------------
    @property
    def pids(self) -> list[int | None]:
        return [core.pid if core is not None else None for core in self.cores]

    def is_alive(self) -> bool:
        return not self._dead and all(core is not None and core.is_alive() for core in self.cores)

    def shutdown(self, timeout_s: float) -> None:
        self._shutdown_cores(timeout_s)

    def _shutdown_cores(self, timeout_s: float) -> None:
        """Stop every core that started, in parallel."""
        threads = [threading.Thread(target=core.shutdown, args=(timeout_s,), daemon=True)
                   for core in self.cores if core is not None]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s + 15.0)


def merge_scheduler_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The server's stats from each core's latest: counts and cumulative counters summed, KV-cache
    usage averaged (every replica has the same pool); other fields are the first core's."""
    spec = [s.spec_decoding for s in stats if s.spec_decoding is not None]
    return dataclasses.replace(
        stats[0],
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions_total=sum(s.num_preemptions_total for s in stats),
        spec_decoding=_merge_spec(spec) if spec else None,
    )


def _merge_spec(stats: list[SpecDecodingStats]) -> SpecDecodingStats:
    per_pos = [sum(col) for col in itertools.zip_longest(*(s.num_accepted_tokens_per_pos for s in stats),
                                                          fillvalue=0)]
    return dataclasses.replace(stats[0], num_drafts=sum(s.num_drafts for s in stats),
                               num_draft_tokens=sum(s.num_draft_tokens for s in stats),
                               num_accepted_tokens=sum(s.num_accepted_tokens for s in stats),
                               num_accepted_tokens_per_pos=per_pos)


def merge_structured_output_stats(reporting, latest: list):
    """The grammar counters summed over each core's latest (cumulative) ones; the compile times of
    the reporting core's new grammars only (the others' were forwarded with their own reports)."""
    summed = ("num_compiled", "num_cache_hits", "bitmask_time_s", "num_bitmask_steps", "num_jumped_tokens")
    return dataclasses.replace(reporting, **{name: sum(getattr(s, name) for s in latest) for name in summed})
