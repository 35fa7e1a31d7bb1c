"""Serving with the engine on a thread of the server vs in a process of its own, same machine.

    python benchmarks/serve_engine_process.py --rounds 3 [--model M] [--device cpu] [-- bench flags]

Each round starts ``pagedllm serve`` once per mode (alternating, the order swapped every round),
replays the same ``pagedllm bench serve`` workload against it (streaming /v1/completions), and
stops it. Prints every run and, per mode, the median of the rounds; ``--output-json`` keeps them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

from pagedllm.entrypoints import bench_serve

MODES = {"thread": "--no-engine-process", "process": "--engine-process"}
KEYS = ("output_throughput", "ttft_ms.p50", "ttft_ms.p99", "tpot_ms.p50", "itl_ms.p50", "itl_ms.p99")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(mode: str, port: int, serve_args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           MODES[mode], "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
           "--stats-log-interval", "0", *serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{mode} server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{mode} server not ready")


def _stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _get(result: dict, key: str) -> float:
    for part in key.split("."):
        result = result[part]
    return float(result)


def run_once(mode: str, serve_args: list[str], bench_ns: argparse.Namespace) -> dict:
    port = _free_port()
    proc = _start_server(mode, port, serve_args)
    try:
        bench_ns.port = port
        result = asyncio.run(bench_serve.run_benchmark(bench_ns))
    finally:
        _stop_server(proc)
    if result["failed"]:
        raise RuntimeError(f"{mode}: {result['failed']} requests failed: {result['errors']}")
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-json", default=None)
    p.add_argument("--serve-args", default="", help="extra flags for pagedllm serve, one string")
    ns, bench_argv = p.parse_known_args()
    bench_parser = argparse.ArgumentParser()
    bench_serve.add_args(bench_parser)
    bench_ns = bench_parser.parse_args([a for a in bench_argv if a != "--"])
    serve_args = ns.serve_args.split()
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for r in range(ns.rounds):
        order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
        for mode in order:
            result = run_once(mode, serve_args, bench_ns)
            runs[mode].append(result)
            print(f"round {r} {mode:<8} " + "  ".join(f"{k}={_get(result, k):.2f}" for k in KEYS), flush=True)
    summary = {mode: {k: statistics.median(_get(x, k) for x in results) for k in KEYS}
               for mode, results in runs.items()}
    for mode, medians in summary.items():
        print(f"median   {mode:<8} " + "  ".join(f"{k}={v:.2f}" for k, v in medians.items()))
    if ns.output_json:
        os.makedirs(os.path.dirname(ns.output_json) or ".", exist_ok=True)
        with open(ns.output_json, "w") as f:
            json.dump({"serve_args": serve_args, "bench_args": vars(bench_ns), "runs": runs, "median": summary},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
