"""The `pagedllm` command: serve, generate, chat, bench {throughput, latency, serve}."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from pagedllm import envs
from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from


def _sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)


def _params(ns):
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k)


def cmd_generate(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    for out in llm.generate(ns.prompts, _params(ns), use_tqdm=False):
        print(f"{out.prompt}{out.outputs[0].text}")
        print("-" * 40)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    params = _params(ns)
    messages: list[dict] = []
    if ns.system:
        messages.append({"role": "system", "content": ns.system})
    if ns.message:
        messages.append({"role": "user", "content": ns.message})
        print(llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text)
        return 0
    print("Interactive chat: empty line or Ctrl-D to quit.")
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        print(reply)
        messages.append({"role": "assistant", "content": reply})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: LLM inference and serving")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+")
    _sampling_args(gen, 64)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model (one-shot with a message, else interactive)")
    chat.add_argument("message", nargs="?", default=None)
    chat.add_argument("--system", default=None)
    _sampling_args(chat, 256)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model", nargs="?", default=None)
    add_engine_args(serve, model_positional=True)
    try:
        from pagedllm.entrypoints.openai.api_server import add_server_args, run_server

        add_server_args(serve)
        serve.set_defaults(func=run_server)
    except ImportError as e:  # the server's packages are part of the install; say what is missing
        _missing = str(e)
        serve.set_defaults(func=lambda ns: sys.exit(f"pagedllm serve needs: {_missing}"))

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from pagedllm.entrypoints import bench_throughput

    tp = bench_sub.add_parser("throughput", help="offline throughput on a synthetic workload")
    bench_throughput.add_args(tp)
    add_engine_args(tp)
    tp.set_defaults(func=bench_throughput.main)
    _add_optional_bench(bench_sub, "latency", "pagedllm.entrypoints.bench_latency")
    _add_optional_bench(bench_sub, "serve", "pagedllm.entrypoints.bench_serve")
    return parser


def _add_optional_bench(sub, name: str, module: str) -> None:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError:
        return
    p = sub.add_parser(name, help=mod.__doc__.splitlines()[0] if mod.__doc__ else name)
    mod.add_args(p)
    if getattr(mod, "NEEDS_ENGINE_ARGS", True):
        add_engine_args(p)
    p.set_defaults(func=mod.main)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=envs.PAGEDLLM_LOG_LEVEL,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    ns = build_parser().parse_args(argv)
    return int(ns.func(ns) or 0)


if __name__ == "__main__":
    sys.exit(main())
