"""The Hugging Face config and tokenizer of a ModelSource (via transformers' Auto classes).

Converting a GGUF file's metadata with transformers is slow (~4 s for the config and as much again
for the tokenizer, because transformers parses every tokenizer field), so both are converted once and
kept as ordinary ``save_pretrained`` folders in the GGUF cache (see cache.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pagedllm.loader.cache import gguf_cache_folder, write_atomically
from pagedllm.loader.source import ModelSource


def _transformers_tag() -> str:
    import transformers

    return f"tf{transformers.__version__}"  # saved configs/tokenizers are read back by the same version


def load_hf_config(source: ModelSource) -> Any:
    """The model's ``transformers.PretrainedConfig``."""
    from transformers import AutoConfig

    if source.kind == "hf":
        return AutoConfig.from_pretrained(source.path)
    cached = gguf_cache_folder(source.path) / f"config-{_transformers_tag()}"
    if (cached / "config.json").is_file():
        return AutoConfig.from_pretrained(cached)
    path = Path(source.path)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
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
    write_atomically(cached, tok.save_pretrained)
    return tok
