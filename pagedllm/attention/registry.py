"""The attention backends by name: ``get_attention_backend(name, device)`` is the one way to get one.

A new backend is a module with an ``AttentionBackend`` subclass plus one ``register_attention_backend``
line here (or a call from its own package). ``"auto"`` names the device's default.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.cpu_backend import CpuBackend
from pagedllm.attention.torch_ref import TorchRefBackend
from pagedllm.attention.triton_backend import TritonBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {}
_DEVICE_DEFAULTS = {"cuda": "triton"}  # any other device type: "cpu"


def register_attention_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Make ``cls`` selectable as ``attention_backend=cls.name``."""
    _BACKENDS[cls.name] = cls
    return cls


for _cls in (CpuBackend, TorchRefBackend, TritonBackend):
    register_attention_backend(_cls)


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """A new backend instance; "auto" means Triton on CUDA, the native-kernel CPU backend elsewhere."""
    if name == "auto":
        name = _DEVICE_DEFAULTS.get(torch.device(device).type, "cpu")
    cls = _BACKENDS.get(name)
    if cls is None:
        names = ", ".join(repr(n) for n in ("auto", *sorted(_BACKENDS)))
        raise ValueError(f"attention_backend must be one of {names}, got {name!r}")
    return cls()
