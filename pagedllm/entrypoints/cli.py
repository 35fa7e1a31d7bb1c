"""The `pagedllm` command: serve, generate, chat, bench {throughput, latency, serve}."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import sys

from pagedllm import envs
from pagedllm.entrypoints.cli_args import HelpFormatter, add_engine_args, engine_args_from


def _sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="most tokens generated per reply")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; higher is more random")
    g.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of tokens whose "
                   "probabilities add up to this")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")


def _params(ns, **changes):
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                          **changes)


def _engine_args(ns: argparse.Namespace):
    """The engine's arguments; sets torch's CPU thread count first (``pagedllm.cpu_threads``)."""
    from pagedllm.cpu_threads import configure_torch_threads

    configure_torch_threads(for_server=False)
    return engine_args_from(ns)


def cmd_generate(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(**dataclasses.asdict(_engine_args(ns)))
    for out in llm.generate(ns.prompts, _params(ns), use_tqdm=False):
        print(f"{out.prompt}{out.outputs[0].text}")
        print("-" * 40)
    return 0


def stream_reply(engine, messages: list[dict], params, out=None) -> str:
    """Generate the assistant's reply to ``messages`` and write it to ``out`` as it comes (one
    write per engine step, flushed); returns the whole reply."""
    from pagedllm.entrypoints.chat_utils import apply_chat_template

    out = out or sys.stdout
    prompt_ids = apply_chat_template(engine.get_tokenizer(), messages)
    request_id = f"chat-{len(messages)}"
    engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, params)
    parts: list[str] = []
    try:
        while engine.has_unfinished_requests():
            for step_out in engine.step():
                text = step_out.outputs[0].text if step_out.outputs else ""
                if text:
                    parts.append(text)
                    out.write(text)
                    out.flush()
    finally:
        engine.abort_request(request_id)  # a no-op once finished; Ctrl-C mid-reply frees it
    out.write("\n")
    out.flush()
    return "".join(parts)


def cmd_chat(ns: argparse.Namespace) -> int:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import RequestOutputKind

    engine = LLMEngine.from_engine_args(_engine_args(ns), "LLM_CLASS")
    params = _params(ns, output_kind=RequestOutputKind.DELTA)
    messages: list[dict] = []
    if ns.system:
        messages.append({"role": "system", "content": ns.system})
    if ns.message:
        messages.append({"role": "user", "content": ns.message})
        stream_reply(engine, messages, params)
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
        reply = stream_reply(engine, messages, params)
        messages.append({"role": "assistant", "content": reply})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: LLM inference and serving",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    # Every sub-command's --help shows each flag's default.
    add_parser = functools.partial(sub.add_parser, formatter_class=HelpFormatter)

    gen = add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+", help="the prompts, each one argument")
    _sampling_args(gen, 64)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = add_parser("chat", help="chat with the model, the reply streamed as it is generated (one-shot "
                      "with a message, else interactive)")
    chat.add_argument("message", nargs="?", default=None, help="the one message to answer (default: interactive)")
    chat.add_argument("--system", default=None, help="a system message to start the conversation with")
    _sampling_args(chat, 256)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model", nargs="?", default=None,
                       help="HF folder, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)")
    add_engine_args(serve, model_positional=True)
    try:
        from pagedllm.entrypoints.openai.api_server import add_server_args, run_server

        add_server_args(serve)
        serve.set_defaults(func=run_server)
    except ImportError as e:  # the server's packages are part of the install; say what is missing
        _missing = str(e)
        serve.set_defaults(func=lambda ns: sys.exit(f"pagedllm serve needs: {_missing}"))

    bench = add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from pagedllm.entrypoints import bench_throughput

    tp = bench_sub.add_parser("throughput", help="offline throughput on a synthetic workload",
                              formatter_class=HelpFormatter)
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
    p = sub.add_parser(name, help=mod.__doc__.splitlines()[0] if mod.__doc__ else name, formatter_class=HelpFormatter)
    mod.add_args(p)
    if getattr(mod, "NEEDS_ENGINE_ARGS", True):
        add_engine_args(p)
    p.set_defaults(func=mod.main)


def main(argv: list[str] | None = None) -> int:
    """Run a sub-command; Ctrl-C ends it quietly with the shell's status for SIGINT (130)."""
    logging.basicConfig(level=envs.PAGEDLLM_LOG_LEVEL,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    ns = build_parser().parse_args(argv)
    try:
        return int(ns.func(ns) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)  # end the line the ^C was echoed on
        return 130


if __name__ == "__main__":
    sys.exit(main())
