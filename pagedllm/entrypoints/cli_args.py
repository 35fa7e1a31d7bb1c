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
    """Add one flag per EngineArgs field, named as vLLM's (--max-num-seqs, ...), with the field's
    help line (``config.arg``); ``HelpFormatter`` adds the default."""
    defaults = EngineArgs()
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model" and model_positional:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        kwargs = {"dest": f.name, "default": default, "help": f.metadata.get("help", "").replace("%", "%%")}
        if f.name in _BOOL_PAIRS or f.name == "async_scheduling":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif isinstance(default, bool):
            group.add_argument(flag, action="store_true", **kwargs)
        elif f.name == "gpu_memory_utilization" or f.type in ("float | None", "float"):
            group.add_argument(flag, type=float, **kwargs)
        elif f.type in ("int | None", "int") or isinstance(default, int):
            group.add_argument(flag, type=int, **kwargs)
        else:
            group.add_argument(flag, type=str, **kwargs)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, plus each option's default unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and action.default is not argparse.SUPPRESS and "(default" not in text:
            text += " (default: %(default)s)"
        return text


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})
