"""Safetensors weights for ``ModelSource.iter_weights``: (Hugging Face parameter name, tensor) pairs,
one tensor at a time (GGUF files are read by ``gguf_file.iter_gguf_weights``).

Safetensors folders: the files named by ``model.safetensors.index.json`` if present, else
``model.safetensors`` if present, else every ``*.safetensors`` (some repos also ship a
``consolidated.safetensors`` in another naming scheme, which the first two rules skip).
Tensors keep their stored dtype; the model casts while copying them into its parameters.

Under tensor parallelism (a tensor-parallel group of more than one rank) the tensors come as
``SafetensorsSlice``: a parameter's loader narrows each to its rank's slice, and only that slice is
read from the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from pagedllm.distributed import get_tp_group


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


class SafetensorsSlice:
    """A checkpoint tensor not read yet. ``narrow(dim, start, length)`` reads only that slice (what a
    tensor-parallel rank's loader asks for); ``shape`` is known without reading; any other use (a
    torch function, an attribute) reads the whole tensor, so a loader that needs it all still works.
    Valid while its file is open: during its step of the iteration that yielded it."""

    def __init__(self, handle, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def dim(self) -> int:
        return len(self.shape)

    def materialize(self) -> torch.Tensor:
        return self._slice[tuple(slice(None) for _ in self.shape)] if self.shape else self._slice[()]

    def __getattr__(self, name: str):
        return getattr(self.materialize(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(x):
            return x.materialize() if isinstance(x, SafetensorsSlice) else x

        return func(*map(real, args), **{k: real(v) for k, v in (kwargs or {}).items()})


def iter_safetensors_weights(folder: str | Path, lazy: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of the folder's checkpoint; ``lazy`` (default: under tensor parallelism)
    yields ``SafetensorsSlice`` instead, read on use."""
    from safetensors import safe_open

    lazy = get_tp_group().size > 1 if lazy is None else lazy
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, SafetensorsSlice(f, name) if lazy else f.get_tensor(name)
