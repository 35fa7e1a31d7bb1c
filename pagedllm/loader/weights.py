"""``iter_weights(source)``: (Hugging Face parameter name, tensor) pairs, one tensor at a time.

Safetensors folders: the files named by ``model.safetensors.index.json`` if present, else
``model.safetensors`` if present, else every ``*.safetensors`` (some repos also ship a
``consolidated.safetensors`` in another naming scheme, which the first two rules skip).
Tensors keep their stored dtype; the model casts while copying them into its parameters.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from pagedllm.loader.gguf_file import iter_gguf_weights
from pagedllm.loader.source import ModelSource


def safetensors_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {folder} (.bin checkpoints are not supported)")
    return files


def iter_safetensors_weights(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def iter_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    if source.kind == "gguf":
        return iter_gguf_weights(source.path)
    return iter_safetensors_weights(source.path)
