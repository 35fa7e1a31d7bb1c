"""Read a supported model's ``config.json`` with plain ``json``, without transformers' config classes.

Why: on transformers 5.17 importing ``transformers.configuration_utils`` (which ``AutoConfig`` and
every ``configuration_<type>`` module need) pulls in ``auto_factory``, scikit-learn,
``torch.distributed.tensor`` (sympy) and ``torch._dynamo``: 7-9 s of engine start-up spent reading
twenty numbers. ``read_plain_config(folder)`` returns a ``PlainConfig`` holding what
``AutoConfig.from_pretrained(folder)`` would give for every attribute pagedllm reads
(``READ_ATTRIBUTES``), or None, and then ``loader.hf.load_hf_config`` uses ``AutoConfig`` as before.

Covered exactly (anything else returns None):
  - ``model_type`` llama, mistral, qwen2 or qwen3; no ``auto_map`` (remote code); a
    ``quantization_config`` only as a JSON object (kept as that dict, as AutoConfig keeps it);
  - default RoPE: no ``rope_scaling``/``rope_parameters``, or one whose only keys are ``rope_type``,
    ``type`` and ``rope_theta`` with type "default"; no top-level ``partial_rotary_factor``;
  - values of the types transformers' strict config classes demand for every field we read
    (``Architecture.config_types``: e.g. positive int sizes, a float ``rms_norm_eps``, a bool ``tie_word_embeddings``),
    a ``dtype``/``torch_dtype`` naming a torch dtype, llama's hidden size a multiple of its heads,
    no ``layer_types`` or one known type per layer: where transformers' validation could complain,
    AutoConfig is left to do it. Fields we do not read are not checked (AutoConfig would reject,
    e.g., a string ``use_cache``; we ignore it).

The defaults (``Architecture.config_defaults`` in ``loader/architectures.py``) and post-processing (``num_key_value_heads`` / ``head_dim`` filled
in, Qwen's ``sliding_window`` cleared unless ``use_sliding_window``, ``rope_theta`` folded into
``rope_parameters``, ``torch_dtype`` read as ``dtype`` and made a ``torch.dtype``) are those of
transformers 5.17-5.23 (``models/<type>/configuration_<type>.py`` and ``configuration_utils``);
tests/loader/test_plain_config.py compares both readers attribute by attribute against the
installed transformers.

``PAGEDLLM_PLAIN_CONFIG=0`` turns the fast path off (``load_hf_config`` then always uses AutoConfig).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from pagedllm.loader.architectures import ARCHITECTURES

# Every config attribute pagedllm reads (models/llama.py, models/registry.py, config.py,
# engine/config_builder.py, engine/llm_engine.py, layers/rotary.py, entrypoints/bench_roofline.py,
# quantization/registry.py).
# ``n_positions``/``max_seq_len``/``seq_length`` are read with getattr defaults; none of the four
# types defines them, so both readers have them only when config.json does.
READ_ATTRIBUTES = (
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
    "n_positions", "max_seq_len", "seq_length", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
    "mlp_bias", "sliding_window", "use_sliding_window", "rope_parameters", "dtype", "torch_dtype",
    "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "quantization_config",
)

_DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta"})
_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})

class PlainConfig:
    """A model config read from config.json without transformers, standing in for its ``PretrainedConfig``.

    Invariant: built only by ``read_plain_config``, i.e. only for the cases its module docstring
    lists (llama/mistral/qwen2/qwen3, default RoPE, no remote code). For those,
    every attribute in ``READ_ATTRIBUTES`` is present exactly when ``AutoConfig``'s is and has the
    same value (``dtype`` a ``torch.dtype``, ``rope_parameters`` ``{"rope_type": "default",
    "rope_theta": ...}`` as in transformers 5). Other config.json keys are kept as they are
    (transformers may normalise some of them; pagedllm does not read them). Anything else goes to
    ``AutoConfig``. Unknown attributes raise AttributeError, so ``getattr(c, name, default)`` works.
    ``rope_scaling`` and ``torch_dtype`` are aliases of ``rope_parameters`` and ``dtype`` (as in
    transformers 5); ``rope_theta`` (absent from transformers 5 configs) is ``rope_parameters``' theta.
    """

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:  # only reached when the attribute is missing
        model_type = self.__dict__.get("model_type")
        raise AttributeError(f"PlainConfig (model_type={model_type!r}) has no attribute {name!r}")

    @property
    def torch_dtype(self) -> Any:
        return self.dtype

    @property
    def rope_scaling(self) -> dict[str, Any]:
        return self.rope_parameters

    @property
    def rope_theta(self) -> float:
        return self.rope_parameters["rope_theta"]

    def to_dict(self) -> dict[str, Any]:
        """The attributes as a JSON-serialisable dict (``dtype`` as its name, e.g. "bfloat16")."""
        out = copy.deepcopy(self.__dict__)
        if out.get("dtype") is not None:
            out["dtype"] = str(out["dtype"]).removeprefix("torch.")
        return out

    def __repr__(self) -> str:
        return f"PlainConfig({json.dumps(self.to_dict(), sort_keys=True)})"


def read_plain_config(folder: str | os.PathLike) -> PlainConfig | None:
    """``folder``'s config.json as a ``PlainConfig``, or None when the fast path does not cover it
    exactly (see the module docstring; also when the file is missing or not a JSON object, so that
    AutoConfig reports the error)."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    model_type = raw.get("model_type")
    arch = ARCHITECTURES.get(model_type)
    if arch is None or arch.config_defaults is None or "auto_map" in raw or not isinstance(raw.get("quantization_config", {}), dict):
        return None
    if "partial_rotary_factor" in raw:
        return None
    values = {**arch.config_defaults, **raw}
    if not all(ok(values[key]) for key, ok in arch.config_types.items()):
        return None
    if model_type == "llama" and values["hidden_size"] % values["num_attention_heads"]:
        return None  # LlamaConfig.validate_architecture refuses it
    rope = _default_rope_parameters(raw)
    dtype = _torch_dtype(raw)
    if rope is None or dtype is False or not _layer_types_ok(values):
        return None
    values.pop("rope_scaling", None)
    values.pop("rope_theta", None)
    values.pop("torch_dtype", None)
    values["rope_parameters"] = rope
    values["dtype"] = dtype
    _post_process(model_type, values)
    return PlainConfig(values)


def _default_rope_parameters(raw: dict[str, Any]) -> dict[str, Any] | None:
    """transformers' standardised ``rope_parameters`` when RoPE is the default type, else None.

    transformers takes ``rope_scaling or rope_parameters or {}``, sets ``rope_theta`` (from the dict,
    else the top-level key, else 10000.0) and ``rope_type`` (from ``type``, else "default")."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict) or not set(params) <= _ROPE_KEYS:
        return None
    if any(params[key] != "default" for key in ("rope_type", "type") if key in params):
        return None
    params = dict(params)
    params.setdefault("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA))
    params.setdefault("rope_type", "default")
    theta = params["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        return None
    return params


def _torch_dtype(raw: dict[str, Any]) -> Any:
    """``dtype`` (else ``torch_dtype``) as a ``torch.dtype``, None when neither is set, False when
    the name is not a torch dtype."""
    name = raw.get("dtype")
    if name is None:
        name = raw.get("torch_dtype")
    if name is None:
        return None
    if not isinstance(name, str):
        return False
    import torch  # already imported by the engine; only on the path when a config names a dtype

    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else False


def _layer_types_ok(values: dict[str, Any]) -> bool:
    """No ``layer_types``, or one known type per layer (otherwise transformers' validation decides)."""
    layer_types = values.get("layer_types")
    if layer_types is None:
        return True
    return (
        isinstance(layer_types, list)
        and len(layer_types) == values["num_hidden_layers"]
        and all(t in _LAYER_TYPES for t in layer_types)
    )


def _post_process(model_type: str, values: dict[str, Any]) -> None:
    """What the config classes' ``__post_init__`` does to the attributes we read."""
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if model_type in ("llama", "mistral") and values["head_dim"] is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if model_type in ("qwen2", "qwen3") and not values["use_sliding_window"]:
        values["sliding_window"] = None
