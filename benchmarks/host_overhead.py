"""Host (CPU) cost of one engine step, without a model: what async scheduling must hide.

Drives the real ``LLMEngine`` -> ``EngineCore.step`` -> ``Scheduler`` -> ``OutputProcessor`` path with
an instant fake model runner that returns one sampled token per request whose scheduled tokens reach
its end (the real runner's rule), and keeps one step in flight as the CUDA engine does. Workload:
N requests with ~1000-token random prompts (prefix caching on, block_size 16), ignore_eos and a
max_tokens larger than the run, so that the measured window is pure steady-state decode of N
requests. Each phase is timed separately with ``time.perf_counter`` over ``--steps`` steps:

- schedule: ``Scheduler.schedule``
- update: ``Scheduler.update_from_output``
- output: ``OutputProcessor.process_outputs`` (EngineCoreOutputs -> RequestOutputs)
- other: the rest of ``LLMEngine.step`` and of the ``LLM.generate`` loop around it (the fake
  runner's own time is excluded; the timing wrappers' own cost is counted here, not in the phases)

    python benchmarks/host_overhead.py                     # N = 1, 32, 256; detokenize off
    python benchmarks/host_overhead.py --detokenize        # also with the embedded tokenizer
    python benchmarks/host_overhead.py --profile 256       # cProfile of the measured steps, N=256

Times are microseconds per step (best of ``--repeats`` runs, each a fresh engine). The machine this
runs on is usually shared: compare ratios measured in one session, not absolute numbers.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import time
from types import SimpleNamespace

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine import llm_engine as llm_engine_module
from pagedllm.engine.engine_core import EngineCore
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

VOCAB_SIZE = 49152  # SmolLM2's, so the embedded tokenizer can decode every id
PHASES = ("schedule", "update", "output", "other")


class _Done:
    """A finished step handle (the fake runner computes everything at launch)."""

    __slots__ = ("_out",)

    def __init__(self, out: ModelRunnerOutput) -> None:
        self._out = out

    def result(self) -> ModelRunnerOutput:
        return self._out


class InstantExecutor:
    """An executor whose "model" is instant: it keeps per-request state from the SchedulerOutput diffs
    (as the real runner does) and samples one token for every request whose computed tokens reach
    its known + in-flight tokens."""

    def __init__(self) -> None:
        self.computed: dict[str, int] = {}
        self.length: dict[str, int] = {}  # tokens the request will have once its last sample lands
        self.seconds = 0.0
        self._launched: _Done | None = None

    def sample_tokens(self, grammar_output=None) -> _Done:
        return self._launched

    def execute_model(self, so: SchedulerOutput) -> None:
        t0 = time.perf_counter()
        computed, length = self.computed, self.length
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            computed.pop(req_id, None)
            length.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
            length[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
        for cached in so.scheduled_cached_reqs:
            computed[cached.req_id] = cached.num_computed_tokens
        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            c = computed[req_id] = computed[req_id] + n
            req_ids.append(req_id)
            if c == length[req_id]:
                length[req_id] = c + 1
                sampled.append([(c * 7919 + 17) % 10000 + 100])
            else:
                sampled.append([])
        out = ModelRunnerOutput(req_ids, sampled)
        self.seconds += time.perf_counter() - t0
        self._launched = _Done(out)


class FakeEngineCore(EngineCore):
    """The real EngineCore.step() with an instant runner: no model, no torch work."""

    def __init__(self, config: EngineConfig, stop_checker=None) -> None:  # no super().__init__(): it builds a model
        self.config = config
        self.cache_config = config.cache_config
        self.executor = InstantExecutor()
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, stop_checker)
        self.async_scheduling = True
        self._in_flight = None
        self.step_timings = {"schedule": 0.0, "execute": 0.0, "update": 0.0, "steps": 0}


def make_config(num_blocks: int, max_model_len: int, skip_tokenizer_init: bool) -> EngineConfig:
    hf_config = SimpleNamespace(vocab_size=VOCAB_SIZE, eos_token_id=2)
    model = ModelConfig("fake", None, hf_config, "bfloat16", max_model_len, skip_tokenizer_init=skip_tokenizer_init)
    return EngineConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=16, num_blocks=num_blocks, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=max_model_len),
        device="cuda", enforce_eager=False, attention_backend="triton", max_logprobs=20,
    )


def make_engine(args, tokenizer):
    config = make_config(args.num_blocks, args.max_model_len, skip_tokenizer_init=tokenizer is None)
    real = llm_engine_module.EngineCore
    llm_engine_module.EngineCore = FakeEngineCore
    try:
        return llm_engine_module.LLMEngine(config, tokenizer=tokenizer)
    finally:
        llm_engine_module.EngineCore = real


class PhaseTimer:
    """Wraps bound methods in place so each call adds its wall time to a phase.

    ``overhead()`` is what the wrapper itself adds to one call's measured time (timer and call
    costs, a few tenths of a microsecond); ``run_once`` subtracts it from each phase.
    """

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.calls = dict.fromkeys(PHASES, 0)

    def wrap(self, obj, name: str, phase: str) -> None:
        fn = getattr(obj, name)
        seconds, calls = self.seconds, self.calls

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                seconds[phase] += time.perf_counter() - t0
                calls[phase] += 1

        setattr(obj, name, timed)

    @staticmethod
    def overhead(num_calls: int = 20000) -> float:
        probe = PhaseTimer()
        target = SimpleNamespace(noop=lambda *a: None)
        probe.wrap(target, "noop", "other")
        best = float("inf")
        for _ in range(5):
            probe.seconds["other"] = 0.0
            for _ in range(num_calls):
                target.noop(1, 2)
            best = min(best, probe.seconds["other"] / num_calls)
        return best


def add_requests(engine, n: int, args, detokenize: bool) -> None:
    rng = random.Random(0)
    kind = RequestOutputKind[args.output_kind.upper()]
    params = SamplingParams(max_tokens=args.max_model_len - 2048, ignore_eos=True, detokenize=detokenize,
                            output_kind=kind)
    for i in range(n):
        prompt = [rng.randint(0, 10000) for _ in range(rng.randint(900, 1100))]
        engine.add_request(str(i), prompt, params)


def generate_loop_body(engine, results: dict) -> None:
    """One iteration of LLM._run's loop (pagedllm/entrypoints/llm.py), without the progress bar."""
    for out in engine.step():
        if out.finished:
            results[out.request_id] = out


def run_once(n: int, args, tokenizer, profile: cProfile.Profile | None = None) -> dict[str, float]:
    engine = make_engine(args, tokenizer)
    add_requests(engine, n, args, detokenize=tokenizer is not None)
    scheduler = engine.engine_core.scheduler
    results: dict = {}
    # Warm up: every prompt computed and every request decoding, then a few more steps.
    while any(r.num_output_tokens < 2 for r in scheduler.requests.values()) or len(scheduler.waiting):
        generate_loop_body(engine, results)
    for _ in range(args.warmup):
        generate_loop_body(engine, results)
    timer = PhaseTimer()
    timer.wrap(scheduler, "schedule", "schedule")
    timer.wrap(scheduler, "update_from_output", "update")
    timer.wrap(engine.output_processor, "process_outputs", "output")
    runner = engine.engine_core.executor
    runner.seconds = 0.0
    if profile is not None:
        profile.enable()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        generate_loop_body(engine, results)
    total = time.perf_counter() - t0
    if profile is not None:
        profile.disable()
    assert len(scheduler.running) == n and not results, "the window must be pure steady-state decode"
    s = timer.seconds
    overhead = PhaseTimer.overhead()
    for phase in ("schedule", "update", "output"):
        s[phase] = max(s[phase] - timer.calls[phase] * overhead, 0.0)  # the wrapper's own time
    s["other"] = total - runner.seconds - s["schedule"] - s["update"] - s["output"]
    return {k: v / args.steps * 1e6 for k, v in s.items()}


def measure(n: int, args, tokenizer) -> dict[str, float]:
    runs = [run_once(n, args, tokenizer) for _ in range(args.repeats)]
    best = {k: min(r[k] for r in runs) for k in PHASES}
    best["total"] = min(sum(r[k] for k in PHASES) for r in runs)
    return best


def embedded_tokenizer():
    from pagedllm.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-blocks", type=int, default=57344, help="KV blocks (an H200 holds ~57k for Qwen3-0.6B)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--output-kind", default="final_only", choices=["final_only", "cumulative", "delta"],
                    help="final_only is what LLM.generate uses; the server streams delta")
    ap.add_argument("--detokenize", action="store_true", help="also measure detokenize=True (embedded tokenizer)")
    ap.add_argument("--profile", type=int, metavar="N", help="cProfile the measured steps of one run with N requests")
    ap.add_argument("--json", help="write the table here")
    args = ap.parse_args()

    if args.profile:
        tokenizer = embedded_tokenizer() if args.detokenize else None
        prof = cProfile.Profile()
        run_once(args.profile, args, tokenizer, prof)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        return

    variants = [("off", None)]
    if args.detokenize:
        variants.append(("on", embedded_tokenizer()))
    rows = []
    print(f"us per step, best of {args.repeats} x {args.steps} steady-state decode steps, output_kind={args.output_kind}")
    print(f"{'N':>5} {'detok':>5} " + " ".join(f"{p:>9}" for p in (*PHASES, "total")) + f" {'sched+upd':>10}")
    for detok, tokenizer in variants:
        for n in args.batch:
            r = measure(n, args, tokenizer)
            rows.append({"N": n, "detokenize": detok == "on", **r})
            cells = " ".join(f"{r[p]:9.1f}" for p in (*PHASES, "total"))
            print(f"{n:5d} {detok:>5} {cells} {r['schedule'] + r['update']:10.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
