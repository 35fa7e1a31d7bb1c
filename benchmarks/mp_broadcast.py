"""Per-step cost of the multiprocess executor's broadcast: one ``SchedulerOutput`` encoded
(``executor/step_codec.py``) and pickled once and written to every worker's pipe, each worker
reading, unpickling and decoding it (what
``executor/multiproc.py`` does per call), timed as a round trip with a one-byte acknowledgement.

    python benchmarks/mp_broadcast.py [--ranks 2] [--steps 2000]

Prints one row per step shape (µs per broadcast, median) and writes JSON to ``$OUT`` if set.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pickle
import statistics
import time

from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.executor.step_codec import decode_scheduler_output, encode_scheduler_output
from pagedllm.sampling_params import SamplingParams


def decode_step(num_reqs: int) -> SchedulerOutput:
    """A pure decode step of ``num_reqs`` running requests, one in 16 getting a new block."""
    cached = [CachedRequestData(f"req-{i}", [i] if i % 16 == 0 else [], 700 + i) for i in range(num_reqs)]
    return SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={c.req_id: 1 for c in cached},
                           total_num_scheduled_tokens=num_reqs)


def mixed_step(num_reqs: int, prompt_len: int) -> SchedulerOutput:
    """A decode step plus one new request with a ``prompt_len``-token prompt."""
    out = decode_step(num_reqs)
    new = NewRequestData("new", list(range(prompt_len)), [], SamplingParams(max_tokens=256),
                         list(range(prompt_len // 16 + 1)), 0)
    out.scheduled_new_reqs.append(new)
    out.num_scheduled_tokens["new"] = prompt_len
    out.total_num_scheduled_tokens += prompt_len
    return out


def _echo(conn) -> None:
    while True:
        message = conn.recv_bytes()
        if message == b"stop":
            return
        decode_scheduler_output(*pickle.loads(message)[1])
        conn.send_bytes(b"k")


def time_broadcast(conns, step: SchedulerOutput, num_steps: int) -> float:
    """Median µs of: pickle once, write to every pipe, wait for every worker's acknowledgement."""
    samples = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        message = pickle.dumps(("execute_model", (encode_scheduler_output(step),)), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in conns:
            conn.send_bytes(message)
        for conn in conns:
            conn.recv_bytes()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    conns, procs = [], []
    for _ in range(args.ranks):
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(target=_echo, args=(child_end,), daemon=True)
        proc.start()
        conns.append(parent_end)
        procs.append(proc)
    shapes = {"decode 1": decode_step(1), "decode 64": decode_step(64), "decode 256": decode_step(256),
              "decode 256 + prompt 1024": mixed_step(256, 1024)}
    rows = []
    for name, step in shapes.items():
        time_broadcast(conns, step, 50)  # warm up
        size = len(pickle.dumps(("execute_model", (encode_scheduler_output(step),)), protocol=pickle.HIGHEST_PROTOCOL))
        rows.append({"step": name, "bytes": size, "us_per_broadcast": time_broadcast(conns, step, args.steps)})
    for conn in conns:
        conn.send_bytes(b"stop")
    for proc in procs:
        proc.join()
    print(f"broadcast to {args.ranks} worker processes (pickle + pipe + unpickle + ack), median of {args.steps}")
    print(f"{'step':<28}{'bytes':>10}{'us':>10}")
    for row in rows:
        print(f"{row['step']:<28}{row['bytes']:>10}{row['us_per_broadcast']:>10.1f}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "mp_broadcast.json"), "w") as f:
            json.dump({"ranks": args.ranks, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
