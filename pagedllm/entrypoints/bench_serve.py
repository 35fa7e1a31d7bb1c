"""Online serving benchmark: replay a synthetic workload against a running OpenAI-compatible server.

    pagedllm serve --port 8000 &
    pagedllm bench serve --port 8000 --num-prompts 64 --max-concurrency 16 --output-json serve.json

Requests are the same ones ``pagedllm bench throughput`` makes (``make_workload``: random token-id
prompts, ignore_eos, seeded), sent as streaming /v1/completions with token-id prompts. Arrivals
follow a Poisson process at ``--request-rate`` requests/s (``inf``: all at once), optionally capped
at ``--max-concurrency`` requests in flight. Reports request throughput, output tokens/s, TTFT,
TPOT (time per output token after the first), ITL and end-to-end latency percentiles, and writes
JSON. The HTTP client is a small asyncio HTTP/1.1 reader, so that the client itself costs the
machine little CPU (client and server often share it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pagedllm.entrypoints.bench_workload import make_workload

NEEDS_ENGINE_ARGS = False  # a client: it takes no engine flags


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (else --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--workload", choices=["random", "nano"], default="random")
    p.add_argument("--num-prompts", "--num-requests", dest="num_prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    p.add_argument("--vocab-limit", type=int, default=10000, help="random prompt ids are drawn from [0, this)")
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in requests/s (inf: send all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per request")
    p.add_argument("--output-json", default=None)


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


# -- a minimal HTTP/1.1 client (one connection per request) ------------------------------------------
async def _http_request(host: str, port: int, method: str, path: str, body: bytes | None,
                        headers: dict[str, str]):
    """Open a connection, send the request; return (status, headers, reader, writer)."""
    reader, writer = await asyncio.open_connection(host, port)
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))
    await writer.drain()
    status_line = await reader.readline()
    parts = status_line.split()
    if len(parts) < 2:
        raise ConnectionError(f"bad status line {status_line!r}")
    resp_headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        k, _, v = line.decode("latin-1").partition(":")
        resp_headers[k.strip().lower()] = v.strip()
    return int(parts[1]), resp_headers, reader, writer


async def _iter_body(reader: asyncio.StreamReader, headers: dict[str, str]):
    """Yield the body's bytes as they arrive (chunked, sized or until close)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise ConnectionError("connection closed before the end of the response")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(65536):
            yield data


async def _get_json(host: str, port: int, path: str, headers: dict[str, str]) -> dict:
    status, h, reader, writer = await _http_request(host, port, "GET", path, None, headers)
    try:
        body = b"".join([c async for c in _iter_body(reader, h)])
    finally:
        writer.close()
    if status != 200:
        raise RuntimeError(f"GET {path}: HTTP {status}: {body[:200]!r}")
    return json.loads(body)


async def _one_request(host: str, port: int, path: str, headers: dict[str, str], payload: dict,
                       timeout: float) -> RequestResult:
    res = RequestResult(prompt_tokens=len(payload["prompt"]))
    try:
        await asyncio.wait_for(_stream_one(host, port, path, headers, payload, res), timeout)
        res.ok = True
    except Exception as e:  # a failed request is reported, never fatal to the run
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _stream_one(host: str, port: int, path: str, headers: dict[str, str], payload: dict,
                      res: RequestResult) -> None:
    t0 = last = time.perf_counter()
    status, h, reader, writer = await _http_request(host, port, "POST", path, json.dumps(payload).encode(), headers)
    done = False
    try:
        buf = b""
        async for data in _iter_body(reader, h):
            buf += data
            if status != 200:
                continue
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event == b"data: [DONE]":
                    done = True
                    continue
                if not event.startswith(b"data: "):
                    continue
                chunk = json.loads(event[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", "error in stream"))
                now = time.perf_counter()
                if chunk.get("choices"):
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {buf[:300].decode(errors='replace')}")
        if not done:
            raise ConnectionError("the stream ended without [DONE]")
        res.latency = time.perf_counter() - t0
    finally:
        writer.close()


# -- the run ---------------------------------------------------------------------------------------
def _percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    import numpy as np

    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


async def run_benchmark(ns: argparse.Namespace) -> dict:
    url = urlsplit(ns.base_url) if ns.base_url else None
    host = url.hostname if url else ns.host
    port = (url.port or 80) if url else ns.port
    root = url.path.rstrip("/") if url else ""
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    model = ns.model
    if model is None:
        model = (await _get_json(host, port, root + "/v1/models", headers))["data"][0]["id"]
    wl = make_workload(ns.workload, ns.num_prompts, tuple(ns.input_len), tuple(ns.output_len), ns.vocab_limit,
                       ns.bench_seed)
    payloads = [
        {"model": model, "prompt": p, "max_tokens": m, "temperature": ns.temperature, "ignore_eos": True,
         "stream": True, "stream_options": {"include_usage": True}}
        for p, m in zip(wl.prompts, wl.max_tokens)
    ]
    sem = asyncio.Semaphore(ns.max_concurrency) if ns.max_concurrency else None
    arrivals = random.Random(ns.bench_seed)

    async def limited(payload: dict) -> RequestResult:
        if sem is None:
            return await _one_request(host, port, root + ns.endpoint, headers, payload, ns.timeout)
        async with sem:
            return await _one_request(host, port, root + ns.endpoint, headers, payload, ns.timeout)

    t0 = time.perf_counter()
    tasks = []
    for payload in payloads:
        tasks.append(asyncio.ensure_future(limited(payload)))
        if ns.request_rate != float("inf"):
            await asyncio.sleep(arrivals.expovariate(ns.request_rate))
    results: list[RequestResult] = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    return summarize(ns, model, results, duration, wl.num_output_tokens)


def summarize(ns: argparse.Namespace, model: str, results: list[RequestResult], duration: float,
              expected_output_tokens: int) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    return {
        "model": model, "workload": ns.workload, "num_prompts": len(results), "completed": len(ok),
        "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if not r.ok})[:5],
        "request_rate": str(ns.request_rate), "max_concurrency": ns.max_concurrency,
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "expected_output_tokens": expected_output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _percentiles([r.ttft for r in ok]), "tpot_ms": _percentiles(tpot), "itl_ms": _percentiles(itl),
        "e2el_ms": _percentiles([r.latency for r in ok]),
    }


def print_summary(r: dict) -> None:
    print(f"{'=' * 16} Serving Benchmark Result {'=' * 16}")
    rows = [
        ("Successful requests", r["completed"]), ("Failed requests", r["failed"]),
        ("Max concurrency", r["max_concurrency"]), ("Request rate (req/s)", r["request_rate"]),
        ("Benchmark duration (s)", f"{r['duration_s']:.2f}"), ("Total input tokens", r["total_input_tokens"]),
        ("Total generated tokens", r["total_output_tokens"]),
        ("Request throughput (req/s)", f"{r['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{r['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{r['total_token_throughput']:.2f}"),
    ]
    for name in ("ttft", "tpot", "itl", "e2el"):
        p = r[f"{name}_ms"]
        rows += [(f"{name.upper()} {k} (ms)", f"{p[k]:.2f}") for k in ("mean", "p50", "p90", "p99")]
    for k, v in rows:
        print(f"{k:<40}{v}")
    for e in r["errors"]:
        print(f"error: {e}")
    print("=" * 58)


def main(ns: argparse.Namespace) -> int:
    result = asyncio.run(run_benchmark(ns))
    print_summary(result)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["failed"] == 0 else 1
