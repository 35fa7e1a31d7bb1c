"""A pooling model's ``PoolerConfig`` from its folder (sentence-transformers files), torch-free.

A sentence-transformers folder lists its modules in ``modules.json``: the Transformer (this
folder), a ``Pooling`` module whose ``config.json`` names the mode (mean, CLS or last token) and
optionally ``Normalize``. Without ``modules.json`` vLLM's defaults apply: CLS for an encoder, the
last token for a decoder, normalized. ``sentence_bert_config.json``'s ``max_seq_length`` caps the
context (sentence-transformers truncates there). Modules pagedllm does not compute (Dense
projections, max pooling, ...) are refused by name rather than skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedllm.pooling_params import PoolerConfig

_MODES = {  # 1_Pooling/config.json key -> pooling type
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_lasttoken": "LAST",
}
_MODE_NAMES = {"mean": "MEAN", "cls": "CLS", "lasttoken": "LAST"}  # sentence-transformers 6's pooling_mode
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError:
        return None
    except ValueError as e:
        raise ValueError(f"model: {path} is not valid JSON: {e}") from None


def _pooling_type(folder: Path, module: dict) -> str:
    """The mode of a Pooling module's config: sentence-transformers 6's ``pooling_mode`` ("mean",
    "cls", "lasttoken", ...) or the older one-flag-per-mode keys."""
    config = _read_json(folder / module.get("path", "") / "config.json") or {}
    mode = config.get("pooling_mode")
    if isinstance(mode, str):
        if mode not in _MODE_NAMES:
            raise ValueError(f"model: sentence-transformers pooling_mode {mode!r} is not supported "
                             f"(one of {list(_MODE_NAMES)})")
        return _MODE_NAMES[mode]
    used = [key for key in (*_MODES, *_UNSUPPORTED_MODES) if config.get(key)]
    if len(used) != 1 or used[0] in _UNSUPPORTED_MODES:
        raise ValueError(f"model: sentence-transformers pooling {used or 'none'} is not supported "
                         f"(one of {list(_MODES)})")
    return _MODES[used[0]]


def read_pooler_config(folder: str | None, hf_config: Any, is_encoder: bool) -> PoolerConfig:
    """The pooling of the model in ``folder`` (None: a model without a folder, e.g. a GGUF file)."""
    root = Path(folder) if folder else None
    modules = _read_json(root / "modules.json") if root is not None else None
    pooling_type, normalize = ("CLS" if is_encoder else "LAST"), True
    if modules is not None:
        if not isinstance(modules, list):
            raise ValueError("model: modules.json must be a list of modules")
        # The class name: its module path differs across sentence-transformers versions.
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
        unsupported = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
        if unsupported:
            raise ValueError(f"model: sentence-transformers modules {unsupported} are not supported "
                             "(Transformer, Pooling and Normalize are)")
        pooling = [m for m, k in zip(modules, kinds) if k == "Pooling"]
        if pooling:
            pooling_type = _pooling_type(root, pooling[0])
        normalize = "Normalize" in kinds
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize, hidden_size=int(hf_config.hidden_size),
                        is_matryoshka=bool(getattr(hf_config, "is_matryoshka", False)),
                        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None)


def sentence_transformers_max_len(folder: str | None) -> int | None:
    """``max_seq_length`` of ``sentence_bert_config.json``, or None."""
    if not folder:
        return None
    config = _read_json(Path(folder) / "sentence_bert_config.json")
    value = config.get("max_seq_length") if isinstance(config, dict) else None
    return value if isinstance(value, int) and value > 0 else None
