"""Safetensors weights for ``ModelSource.iter_weights``: (Hugging Face parameter name, tensor) pairs,
one tensor at a time (GGUF files are read by ``gguf_file.iter_gguf_weights``).

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
