"""Read and check a PEFT LoRA folder without torch: the engine refuses a bad adapter up front.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or the older
``adapter_model.bin``). Supported: LoRA (``peft_type`` "LORA") on the projections of a decoder layer
(``SUPPORTED_TARGETS``), one rank for every module (``r``), scaling ``lora_alpha / r`` or with
``use_rslora`` ``lora_alpha / sqrt(r)``. Refused, each with a ``ValueError`` naming the caller's
field: a rank above ``max_lora_rank``, another target (embeddings, the LM head, ...),
``modules_to_save``, DoRA, LoRA biases, per-module rank or alpha patterns. With a safetensors file
the tensor names and shapes are checked too (its header is plain JSON), against the shapes the
base model's config implies; a ``.bin`` file is checked by the config alone.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
_PEFT_PREFIX = "base_model.model."
_MAX_HEADER_BYTES = 100 * 2**20


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter folder. ``scaling`` multiplies ``B @ A``; ``weights_file`` is its path."""

    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    weights_file: str


def lora_weight_name(key: str) -> tuple[str, str] | None:
    """``(module path in the model, "A" | "B")`` of a PEFT tensor name, or None for another tensor:
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ->
    ``("model.layers.0.self_attn.q_proj", "A")``."""
    name = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
    for part in ("A", "B"):
        marker = f".lora_{part}."
        if marker in name and name.endswith(".weight"):
            return name.split(marker)[0], part
    return None


def model_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """``(out_features, in_features)`` of each supported target in a Llama-shaped decoder."""
    hidden = int(hf_config.hidden_size)
    heads = int(hf_config.num_attention_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads) * head_dim
    inter = int(getattr(hf_config, "intermediate_size", 0) or 0)
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
            "o_proj": (hidden, heads * head_dim), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def read_adapter_spec(path: str, max_lora_rank: int, hf_config: Any = None, field: str = "lora_request") -> AdapterSpec:
    """Check the folder at ``path`` (module doc); every error is a ``ValueError`` starting with
    ``field``. ``hf_config``: the base model's config, for the shape check (None: no shape check)."""
    if not os.path.isdir(path):
        raise ValueError(f"{field}: {path!r} is not a PEFT adapter folder (no such directory)")
    config = _read_config(path, field)
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{field}: adapter {path!r} has no valid rank r in {CONFIG_NAME} (got {rank!r})")
    if rank > max_lora_rank:
        raise ValueError(f"{field}: adapter {path!r} has rank {rank}, above max_lora_rank ({max_lora_rank}); "
                         f"start the engine with max_lora_rank >= {rank}")
    _refuse_unsupported(config, path, field)
    alpha = config.get("lora_alpha", 8)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = next((os.path.join(path, n) for n in WEIGHTS_NAMES if os.path.isfile(os.path.join(path, n))), None)
    if weights is None:
        raise ValueError(f"{field}: adapter {path!r} has no weights file (one of {list(WEIGHTS_NAMES)})")
    if not isinstance(config.get("target_modules"), str):  # a list (a regex string is judged by the tensors)
        _config_targets(config, path, field)
    if weights.endswith(".safetensors"):
        targets = _check_tensors(_safetensors_shapes(weights, field), rank, hf_config, path, field)
    else:
        targets = _config_targets(config, path, field)
    return AdapterSpec(path=path, rank=rank, scaling=float(scaling), target_modules=targets, weights_file=weights)


def _read_config(path: str, field: str) -> dict:
    file = os.path.join(path, CONFIG_NAME)
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{field}: {path!r} is not a PEFT adapter folder (no {CONFIG_NAME})") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{field}: {file!r} could not be read: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{field}: {file!r} is not a JSON object")
    return config


def _refuse_unsupported(config: dict, path: str, field: str) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"{field}: adapter {path!r} is a {peft_type} adapter; only LoRA is supported")
    if config.get("modules_to_save"):
        raise ValueError(f"{field}: adapter {path!r} has modules_to_save {config['modules_to_save']}, which is "
                         "not supported (only LoRA matrices on the decoder projections)")
    if config.get("use_dora"):
        raise ValueError(f"{field}: adapter {path!r} uses DoRA (use_dora), which is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{field}: adapter {path!r} trains biases (bias={config['bias']!r}), which is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"{field}: adapter {path!r} has a {key}, which is not supported (one rank and alpha)")


def _config_targets(config: dict, path: str, field: str) -> tuple[str, ...]:
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"{field}: adapter {path!r} names no target_modules")
    unsupported = sorted(set(targets) - set(SUPPORTED_TARGETS))
    if unsupported:
        raise ValueError(f"{field}: adapter {path!r} targets {unsupported}; supported targets: {list(SUPPORTED_TARGETS)}")
    return tuple(sorted(set(targets)))


def _safetensors_shapes(file: str, field: str) -> dict[str, list[int]]:
    """Tensor name -> shape, from the file's JSON header (no tensor is read)."""
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER_BYTES:
                raise ValueError("header too large")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as e:
        raise ValueError(f"{field}: {file!r} is not a readable safetensors file: {e}") from None
    return {k: v.get("shape", []) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def _check_tensors(shapes: dict[str, list[int]], rank: int, hf_config: Any, path: str, field: str) -> tuple[str, ...]:
    expected = model_shapes(hf_config) if hf_config is not None else None
    num_layers = int(hf_config.num_hidden_layers) if hf_config is not None else None
    targets: set[str] = set()
    parts_of: dict[str, set[str]] = {}
    for key, shape in shapes.items():
        parsed = lora_weight_name(key)
        if parsed is None:
            kind = "embedding LoRA" if "lora_embedding" in key else "a tensor other than a LoRA matrix"
            raise ValueError(f"{field}: adapter {path!r} holds {key!r} ({kind}), which is not supported")
        module, part = parsed
        short = module.rsplit(".", 1)[-1]
        if short not in SUPPORTED_TARGETS:
            raise ValueError(f"{field}: adapter {path!r} targets {short!r} ({key}); supported targets: "
                             f"{list(SUPPORTED_TARGETS)}")
        layer = _layer_index(module)
        if layer is None or (num_layers is not None and layer >= num_layers):
            raise ValueError(f"{field}: adapter {path!r} holds {key!r}, which is no layer of the base model")
        if len(shape) != 2 or (shape[0] if part == "A" else shape[1]) != rank:
            raise ValueError(f"{field}: adapter {path!r}: {key} has shape {shape}, not of rank {rank}")
        if expected is not None:
            out_features, in_features = expected[short]
            want = in_features if part == "A" else out_features
            got = shape[1] if part == "A" else shape[0]
            if got != want:
                raise ValueError(f"{field}: adapter {path!r}: {key} has shape {shape}, which does not fit the "
                                 f"base model's {short} ({out_features} x {in_features})")
        targets.add(short)
        parts_of.setdefault(module, set()).add(part)
    halves = sorted(m for m, parts in parts_of.items() if len(parts) != 2)
    if halves:
        raise ValueError(f"{field}: adapter {path!r} lacks lora_A or lora_B of {halves[:4]}")
    if not targets:
        raise ValueError(f"{field}: adapter {path!r} holds no LoRA matrices")
    return tuple(sorted(targets))


def _layer_index(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) >= 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None
