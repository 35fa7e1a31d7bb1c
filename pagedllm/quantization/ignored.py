"""Which linear layers a checkpoint's quantization config keeps in float (its ignore list).

Entries name checkpoint modules (``model.layers.0.mlp.down_proj``), or are ``re:<pattern>``
regular expressions over those names (compressed-tensors). Our merged layers (``qkv_proj``,
``gate_up_proj``) stand for several checkpoint modules, given by the model's
``packed_modules_mapping`` (vLLM's name): such a layer is skipped when all of its parts are, and a
list that skips only some of them is refused (one GEMM cannot be half quantized).
"""

from __future__ import annotations

import re


def _matches(name: str, entry: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return name == entry or name.endswith("." + entry)


def is_layer_skipped(prefix: str, ignored: list[str], packed_modules_mapping: dict[str, list[str]]) -> bool:
    """Whether the layer named ``prefix`` (our module name) stays unquantized."""
    if not ignored:
        return False
    parent, _, leaf = prefix.rpartition(".")
    parts = packed_modules_mapping.get(leaf)
    names = [f"{parent}.{p}" if parent else p for p in parts] if parts else [prefix]
    skipped = [any(_matches(n, e) for e in ignored) for n in names]
    if any(skipped) and not all(skipped):
        raise ValueError(f"quantization: the checkpoint's quantization_config ignores only some of {names}, "
                         f"which this engine runs as one merged layer ({prefix})")
    return all(skipped)
