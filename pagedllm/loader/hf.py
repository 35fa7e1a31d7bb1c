"""The Hugging Face config and tokenizer of a ModelSource (via transformers' Auto classes).

The config of a plain llama/mistral/qwen2/qwen3 folder (and a GGUF file's cached converted config)
is read without transformers by ``plain_config.read_plain_config``: importing AutoConfig costs
7-9 s of start-up on transformers 5.17. ``PAGEDLLM_PLAIN_CONFIG=0`` turns that off (always AutoConfig).

Converting a GGUF file's metadata with transformers is slow (~4 s for the config and as much again
for the tokenizer, because transformers parses every tokenizer field), so both are converted once and
kept as ordinary ``save_pretrained`` folders in the GGUF cache (see cache.py).
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Any

from pagedllm import envs
from pagedllm.loader.cache import ensure_entry, gguf_cache_folder, write_atomically
from pagedllm.loader.plain_config import read_plain_config
from pagedllm.loader.source import ModelSource


def _transformers_tag() -> str:
    # Saved configs/tokenizers are read back by the same version. The installed distribution's
    # version, not ``transformers.__version__``: importing transformers is not needed to read a config.
    return f"tf{importlib.metadata.version('transformers')}"


def _plain_config_enabled() -> bool:
    return envs.PAGEDLLM_PLAIN_CONFIG


def _read_config(folder: str | os.PathLike) -> Any:
    """``folder``'s config: a ``PlainConfig`` where that covers it exactly, else AutoConfig's."""
    if _plain_config_enabled():
        config = read_plain_config(folder)
        if config is not None:
            return config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def load_hf_config(source: ModelSource) -> Any:
    """The model's config: a ``plain_config.PlainConfig`` for a config it covers (the same values
    for every attribute pagedllm reads), else a ``transformers.PretrainedConfig``."""
    if source.kind == "hf":
        return _read_config(source.path)
    cached = gguf_cache_folder(source.path) / f"config-{_transformers_tag()}"
    if (cached / "config.json").is_file():
        return _read_config(cached)
    from transformers import AutoConfig

    path = Path(source.path)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    ensure_entry(cached.parent, path)
    write_atomically(cached, config.save_pretrained)
    return config


def load_tokenizer(source: ModelSource, tokenizer: str | os.PathLike | None = None) -> Any:
    """The tokenizer: from ``tokenizer`` (a folder, .gguf file or hub id) if given, else from the model."""
    from transformers import AutoTokenizer

    if tokenizer is None:
        if source.kind == "gguf":
            return _gguf_tokenizer(Path(source.path))
        return AutoTokenizer.from_pretrained(source.path)
    name = os.fspath(tokenizer)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_tokenizer(path)
    try:
        return AutoTokenizer.from_pretrained(path if path.is_dir() else name)
    except Exception as e:  # one clear message naming the field
        raise ValueError(
            f"tokenizer={name!r}: not a tokenizer folder, .gguf file or loadable hub id "
            f"({type(e).__name__}: {e})"
        ) from e


def _gguf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    cached = gguf_cache_folder(path) / f"tokenizer-{_transformers_tag()}"
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(cached)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ensure_entry(cached.parent, path)
    write_atomically(cached, tok.save_pretrained)
    return tok
