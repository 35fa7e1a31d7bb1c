"""CPU cost of structured output per engine step, and how much of it a simulated GPU hides.

Drives the real ``LLMEngine`` -> ``EngineCore.step`` -> ``Scheduler`` -> ``StructuredOutputManager``
-> ``OutputProcessor`` path (detokenizing, with the real SmolLM2 tokenizer: 49k tokens) with a
simulated GPU in place of the model: one stream on which each step's forward takes
``--forward-ms`` and its sampling ``--sample-ms`` after launch (``result()`` sleeps until then).
Every request replays the tokens of one valid JSON document of the nested or bounded schema of
``benchmarks/gpu/structured_output_bench.py`` (random instances, canonically tokenized, EOS at the
end; ``max_tokens`` 256 cuts the long ones): the "sampler" emits the document's next token, and in
constrained runs checks that the step's bitmask allows it (a refused token fails the run). The same
streams run once free (no grammar) and once constrained, alternately, so the difference is the
cost of the grammar.

Reported per (N, schema, mode), per step of the whole run (N requests x up to 256 tokens), in
microseconds; the phases are the engine thread's CPU time in them (``time.thread_time``: waits
excluded, and robust to a loaded machine, unlike the wall times):
- step: wall time per step (with the simulated GPU: what throughput sees);
- engine_cpu: all the engine thread's CPU time (not the fill thread's work): the cost that decides
  the step time once the engine thread is the bottleneck;
- schedule / update / output: ``Scheduler.schedule``, ``Scheduler.update_from_output`` (where the
  matchers accept the tokens), ``OutputProcessor.process_outputs``;
- bitmask: the manager's per-step bitmask calls (choosing the rows, starting the fill);
- fill: time xgrammar spent filling bitmasks (on whichever thread ran it);
- fill_wait: the part of ``fill`` the engine thread waited for (0 when it is fully hidden behind
  the engine thread's own work; absent before the fill thread existed);
- gpu_idle: time the simulated GPU had nothing queued while requests were running.

    python benchmarks/structured_step_overhead.py                       # N = 64, 256; both schemas
    python benchmarks/structured_step_overhead.py --forward-ms 0         # pure CPU cost, no GPU to hide it
    python benchmarks/structured_step_overhead.py --batch 256 --schema nested --profile

The machine it runs on is often shared: compare free and constrained rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE), str(_HERE / "gpu")]  # this checkout's pagedllm first

from host_overhead import make_config  # noqa: E402
from structured_output_bench import SCHEMAS  # noqa: E402

from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput  # noqa: E402
from pagedllm.core.scheduler import Scheduler  # noqa: E402
from pagedllm.engine import llm_engine as llm_engine_module  # noqa: E402
from pagedllm.engine.engine_core import EngineCore  # noqa: E402
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output import StructuredOutputManager  # noqa: E402

PHASES = ("step", "engine_cpu", "schedule", "update", "output", "bitmask", "fill", "fill_wait", "gpu_idle")
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu street city river road house "
         "Rome Paris Berlin Madrid Lisbon Vienna the of and to in is was for on with as by at from").split()


# -- workload ----------------------------------------------------------------------------------
def document(schema_name: str, rng: random.Random) -> dict:
    """A random instance of the schema (valid for both NESTED_SCHEMA and BOUNDED_SCHEMA)."""
    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    name = words(2, 6)
    if schema_name == "bounded":
        name = name[:40]
    return {
        "id": rng.randint(0, 10**6), "name": name, "status": rng.choice(["active", "inactive", "pending"]),
        "address": {"street": words(2, 5), "city": rng.choice(WORDS), "zip": f"{rng.randint(0, 99999):05d}"},
        "tags": rng.sample(["a", "b", "c", "d"], rng.randint(0, 4)),
        "scores": [round(rng.uniform(0, 100), rng.randint(0, 3)) for _ in range(rng.randint(0, 6))],
        "notes": words(20, 240),
    }


def token_streams(tokenizer, schema_name: str, n: int, eos: int, seed: int = 0) -> list[list[int]]:
    """n documents' canonical tokens, each followed by ``eos`` (the grammars' stop token)."""
    rng = random.Random(seed)
    return [tokenizer.encode(json.dumps(document(schema_name, rng)), add_special_tokens=False) + [eos]
            for _ in range(n)]


# -- the simulated GPU -------------------------------------------------------------------------
class _Handle:
    __slots__ = ("_out", "_done_at")

    def __init__(self, out: ModelRunnerOutput, done_at: float) -> None:
        self._out, self._done_at = out, done_at

    def result(self) -> ModelRunnerOutput:
        delay = self._done_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return self._out


class SimulatedGpuExecutor:
    """One stream: a forward starts when launched and the stream is free, and takes ``forward_s``;
    a sampling starts after it and when ``sample_tokens`` is called, and takes ``sample_s``. The
    "sampler" emits each request's next stream token (stream keyed by request id), checking the
    bitmask rows when given. Keeps per-request state from the SchedulerOutput diffs like the real
    runner (a request samples when its computed tokens reach its known + in-flight tokens).

    ``idle_s``: stream time with nothing queued, between the first and the last launch."""

    def __init__(self, streams: dict[str, list[int]], forward_s: float, sample_s: float) -> None:
        self.streams = streams
        self.forward_s, self.sample_s = forward_s, sample_s
        self.computed: dict[str, int] = {}
        self.length: dict[str, int] = {}
        self.emitted: dict[str, int] = {}
        self.free_at = 0.0
        self.idle_s = 0.0
        self.num_checked = 0
        self._launched: list[str] | None = None  # request ids sampling in the launched forward

    def _occupy(self, seconds: float) -> None:
        now = time.perf_counter()
        if self.free_at and now > self.free_at:
            self.idle_s += now - self.free_at
        self.free_at = max(now, self.free_at) + seconds

    def execute_model(self, so: SchedulerOutput) -> None:
        computed, length = self.computed, self.length
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            computed.pop(req_id, None)
            length.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
            length[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.emitted[new.req_id] = len(new.output_token_ids)
        for cached in so.scheduled_cached_reqs:
            computed[cached.req_id] = cached.num_computed_tokens
        sampling = []
        for req_id, n in so.num_scheduled_tokens.items():
            c = computed[req_id] = computed[req_id] + n
            if c == length[req_id]:
                length[req_id] = c + 1
                sampling.append(req_id)
        self._launched = sampling
        if so.total_num_scheduled_tokens:
            self._occupy(self.forward_s)

    def sample_tokens(self, grammar_output=None) -> _Handle | None:
        sampling, self._launched = self._launched, None
        if sampling is None:
            return None
        tokens = {}
        for req_id in sampling:
            k = self.emitted[req_id]
            stream = self.streams[req_id]
            tokens[req_id] = stream[min(k, len(stream) - 1)]
            self.emitted[req_id] = k + 1
        if grammar_output is not None:
            for row, req_id in enumerate(grammar_output.req_ids):
                token = tokens[req_id]
                if not (int(grammar_output.bitmask[row, token >> 5]) >> (token & 31)) & 1:
                    raise AssertionError(f"{req_id}: token {token} is not allowed by its bitmask")
                self.num_checked += 1
        req_ids = list(tokens)
        out = ModelRunnerOutput(req_ids, [[tokens[r]] for r in req_ids])
        if req_ids:
            self._occupy(self.sample_s)
        return _Handle(out, self.free_at)

    def shutdown(self) -> None:
        pass


class SimulatedEngineCore(EngineCore):
    """The real EngineCore with the simulated GPU (no model, no torch)."""

    def __init__(self, config, stop_checker=None, tokenizer=None) -> None:  # no super().__init__(): a model
        self.config = config
        self.cache_config = config.cache_config
        self.executor = None  # set by make_engine (it knows the streams)
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, stop_checker)
        self.structured_output = StructuredOutputManager(tokenizer, config.model_config.vocab_size)
        self.async_scheduling = True
        self._in_flight = None
        self.step_timings = {"schedule": 0.0, "execute": 0.0, "update": 0.0, "steps": 0}


# -- one run -----------------------------------------------------------------------------------
def make_engine(tokenizer):
    config = make_config(num_blocks=8192, max_model_len=2048, skip_tokenizer_init=False)
    real = llm_engine_module.EngineCore
    llm_engine_module.EngineCore = SimulatedEngineCore
    try:
        return llm_engine_module.LLMEngine(config, tokenizer=tokenizer)
    finally:
        llm_engine_module.EngineCore = real


def run_once(engine, streams: list[list[int]], schema: dict | None, args, profile=None) -> dict[str, float]:
    """All requests from start to finish; per-step averages over the steps that ran requests."""
    core = engine.engine_core
    ids = [f"{'json' if schema else 'free'}-{run_once.counter}-{i}" for i in range(len(streams))]
    run_once.counter += 1
    core.executor = SimulatedGpuExecutor(dict(zip(ids, streams)), args.forward_ms / 1e3, args.sample_ms / 1e3)
    grammar = StructuredOutputsParams(json=schema) if schema is not None else None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, structured_outputs=grammar)
    rng = random.Random(1)
    for req_id in ids:
        engine.add_request(req_id, [rng.randrange(100, 10000) for _ in range(args.prompt_len)], params)
    manager = core.structured_output
    if schema is not None:  # compile before timing (the GPU bench's warm-up does the same)
        manager.wait_for_compile(timeout_s=60)
    seconds: dict[str, float] = {}
    unwrap = [_time_calls(core.scheduler, "schedule", "schedule", seconds),
              _time_calls(core.scheduler, "update_from_output", "update", seconds),
              _time_calls(engine.output_processor, "process_outputs", "output", seconds)]
    bitmask_before = manager.bitmask_time_s
    wait_before = getattr(manager, "bitmask_wait_s", 0.0)
    for name in ("start_bitmask", "finish_bitmask") if hasattr(manager, "start_bitmask") else ("grammar_bitmask",):
        unwrap.append(_time_calls(manager, name, "bitmask", seconds))
    num_steps, num_tokens = 0, 0
    if profile is not None:
        profile.enable()
    t0, cpu0 = time.perf_counter(), time.thread_time()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                num_tokens += len(out.outputs[0].token_ids)
        num_steps += 1
    elapsed, engine_cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    if profile is not None:
        profile.disable()
    for undo in unwrap:
        undo()
    result = {phase: seconds.get(phase, 0.0) / num_steps * 1e6 for phase in PHASES}
    result["step"] = elapsed / num_steps * 1e6
    result["engine_cpu"] = engine_cpu / num_steps * 1e6
    result["fill"] = (manager.bitmask_time_s - bitmask_before) / num_steps * 1e6
    result["fill_wait"] = (getattr(manager, "bitmask_wait_s", 0.0) - wait_before) / num_steps * 1e6
    result["gpu_idle"] = core.executor.idle_s / num_steps * 1e6
    result.update(steps=num_steps, tokens=num_tokens, tok_s=num_tokens / elapsed, checked=core.executor.num_checked)
    return result


run_once.counter = 0


def _time_calls(obj, name: str, phase: str, seconds: dict[str, float]):
    """Add the engine thread's CPU time (``time.thread_time``: waits excluded) in ``obj.name`` to
    ``seconds[phase]``; returns the function that unwraps it."""
    fn = getattr(obj, name)
    seconds.setdefault(phase, 0.0)

    def timed(*args, **kwargs):
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[phase] += time.thread_time() - t0

    setattr(obj, name, timed)
    return lambda: vars(obj).pop(name, None)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default="/work/main/.tok/smollm2")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--schema", nargs="+", choices=sorted(SCHEMAS), default=["nested", "bounded"])
    ap.add_argument("--forward-ms", type=float, default=5.0, help="simulated forward time per step")
    ap.add_argument("--sample-ms", type=float, default=0.3, help="simulated sampling time per step")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="free/constrained pairs; the best of each is kept")
    ap.add_argument("--profile", action="store_true", help="cProfile the constrained runs of the first N and schema")
    ap.add_argument("--output-json", default=None, help="default: $OUT/structured_step_overhead.json if $OUT is set")
    args = ap.parse_args()

    tokenizer = load_tokenizer(args.tokenizer)
    engine = make_engine(tokenizer)
    rows = []
    print(f"us per step (best of {args.rounds}); simulated forward {args.forward_ms} ms + sample {args.sample_ms} ms")
    print(f"{'N':>4} {'schema':>7} {'mode':>5} " + " ".join(f"{p:>8}" for p in PHASES) + f" {'tok/s':>8} {'ratio':>6}")
    for n in args.batch:
        for schema_name in args.schema:
            streams = token_streams(tokenizer, schema_name, n, engine.eos_token_id)
            schema = SCHEMAS[schema_name]
            run_once(engine, streams[:8], schema, args)  # warm-up: the compile, the tokenizer's caches
            best: dict[str, dict] = {}
            for _ in range(args.rounds):
                for mode, constraint in (("free", None), ("json", schema)):
                    r = run_once(engine, streams, constraint, args)
                    if mode not in best or r["step"] < best[mode]["step"]:
                        best[mode] = r
            if args.profile:
                prof = cProfile.Profile()
                run_once(engine, streams, schema, args, prof)
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
                args.profile = False
            for mode in ("free", "json"):
                r = best[mode]
                ratio = r["tok_s"] / best["free"]["tok_s"]
                rows.append({"N": n, "schema": schema_name, "mode": mode, **r, "ratio": ratio})
                cells = " ".join(f"{r[p]:8.0f}" for p in PHASES)
                print(f"{n:4d} {schema_name:>7} {mode:>5} {cells} {r['tok_s']:8.0f} {ratio:6.3f}", flush=True)
    path = args.output_json or (os.path.join(os.environ["OUT"], "structured_step_overhead.json")
                                if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump({"forward_ms": args.forward_ms, "sample_ms": args.sample_ms, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
