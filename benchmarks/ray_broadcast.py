"""Per-step cost of reaching the Ray executor's actors, three ways, on a local Ray instance:

- ``ray.get`` on one remote call per actor (the plain Ray baseline: a task per rank and step);
- a Ray compiled graph (``experimental_compile``) broadcasting the step to every actor;
- what ``RayExecutor`` does: pickle the step once and write it to one TCP
  ``multiprocessing.connection`` per actor (``executor/conn_executor.py``).

Each is timed as a round trip: the actors decode the ``SchedulerOutput`` (``step_codec.py``) and
acknowledge, so the figures are comparable with ``benchmarks/mp_broadcast.py`` (pipes).

    python benchmarks/ray_broadcast.py [--ranks 2] [--steps 1000]

Prints one row per step shape (µs per broadcast, median) and writes JSON to ``$OUT`` if set.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import secrets
import statistics
import time
from multiprocessing.connection import Client, Listener

import ray
from mp_broadcast import decode_step, mixed_step

from pagedllm.executor.step_codec import decode_scheduler_output, encode_scheduler_output


class Echo:
    """Decodes a step and acknowledges it, as a Ray method or over a connection."""

    def step(self, wire):
        decode_scheduler_output(wire)
        return b"k"

    def listen(self, authkey: bytes):
        self._listener = Listener((ray.util.get_node_ip_address(), 0), authkey=authkey)
        return self._listener.address

    def serve(self) -> None:
        import threading

        def run() -> None:
            conn = self._listener.accept()
            while (message := conn.recv_bytes()) != b"stop":
                decode_scheduler_output(pickle.loads(message)[1][0])
                conn.send_bytes(b"k")

        threading.Thread(target=run, daemon=True).start()


def _median_us(fn, num_steps: int) -> float:
    for _ in range(min(50, num_steps)):
        fn()
    samples = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    ray.init(num_cpus=args.ranks, include_dashboard=False, logging_level="WARNING")
    actors = [ray.remote(num_cpus=1)(Echo).remote() for _ in range(args.ranks)]
    authkey = secrets.token_bytes(32)
    addresses = ray.get([a.listen.remote(authkey) for a in actors])
    ray.get([a.serve.remote() for a in actors])
    conns = [Client(tuple(address), authkey=authkey) for address in addresses]
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as wire:
        graph = MultiOutputNode([a.step.bind(wire) for a in actors]).experimental_compile()

    def over_connections(step):
        message = pickle.dumps(("execute_model", (encode_scheduler_output(step),)), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in conns:
            conn.send_bytes(message)
        for conn in conns:
            conn.recv_bytes()

    ways = {
        "ray.get of remote calls": lambda step: ray.get([a.step.remote(encode_scheduler_output(step)) for a in actors]),
        "compiled graph": lambda step: ray.get(graph.execute(encode_scheduler_output(step))),
        "TCP connections (RayExecutor)": over_connections,
    }
    shapes = {"decode 1": decode_step(1), "decode 64": decode_step(64), "decode 256": decode_step(256),
              "decode 256 + prompt 1024": mixed_step(256, 1024)}
    rows = []
    for name, step in shapes.items():
        row = {"step": name}
        for way, fn in ways.items():
            row[way] = _median_us(lambda: fn(step), args.steps)  # noqa: B023 - called at once
        rows.append(row)
    graph.teardown()
    for conn in conns:
        conn.send_bytes(b"stop")
    ray.shutdown()
    print(f"broadcast to {args.ranks} Ray actors (encode + send + decode + ack), µs, median of {args.steps}")
    print(f"{'step':<28}" + "".join(f"{way:>32}" for way in ways))
    for row in rows:
        print(f"{row['step']:<28}" + "".join(f"{row[way]:>32.1f}" for way in ways))
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "ray_broadcast.json"), "w") as f:
            json.dump({"ranks": args.ranks, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
