"""The engine's command-line flags: one per ``EngineArgs`` field, named as vLLM's.

Shared by every command that builds an engine (``pagedllm serve``, ``generate``, ``chat``, the
benchmarks); a module of its own so that those commands need not import the CLI that lists them.
"""

from __future__ import annotations

import argparse
import dataclasses

from pagedllm.config import EngineArgs

# Flags whose vLLM spelling is a boolean pair (--x / --no-x).
_BOOL_PAIRS = ("enable_prefix_caching", "enable_chunked_prefill")


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """Add one flag per EngineArgs field, named as vLLM's (--max-num-seqs, ...)."""
    defaults = EngineArgs()
    if not model_positional:
        parser.add_argument("--model", default=None, help="HF folder, .gguf file or hub id (default: embedded SmolLM2)")
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if f.name in _BOOL_PAIRS or f.name == "async_scheduling":
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default)
        elif isinstance(default, bool):
            parser.add_argument(flag, dest=f.name, action="store_true", default=default)
        elif f.name == "gpu_memory_utilization" or f.type in ("float | None", "float"):
            parser.add_argument(flag, dest=f.name, type=float, default=default)
        elif f.type in ("int | None", "int") or isinstance(default, int):
            parser.add_argument(flag, dest=f.name, type=int, default=default)
        else:
            parser.add_argument(flag, dest=f.name, type=str, default=default)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})
