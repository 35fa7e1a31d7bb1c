"""What the model runner may call on a model: the interface every model class provides.

``CausalLM`` is a ``Protocol``: a model class need not inherit from it, but ``check_model`` (called
by ``models/registry.build_model`` on every model it builds) raises TypeError naming what a class
lacks. The runner calls nothing else on a model (kernel preparation goes through
``layers/dispatch.prepare_model_kernels``, which looks only at the model's layer modules).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from pagedllm.layers import Attention


@runtime_checkable
class CausalLM(Protocol):
    """A causal language model over flattened tokens (no batch dim), run inside the runner's
    ``forward_context`` (which gives the attention layers their backend and step metadata)."""

    config: Any  # the HF (or plain) config the model was built from
    max_supported_len: int | None  # a length cap beyond max_position_embeddings (e.g. a sliding window)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` -> hidden states ``[T, hidden_size]``. Under pipeline
        parallel a stage after the first starts from ``intermediate`` (the previous stage's
        residual stream ``[T, hidden_size]``) and a stage before the last returns its own residual
        stream; the runner moves it between stages (``worker/pipeline_stage.py``)."""
        ...

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """``[N, hidden_size]`` -> ``[N, vocab_size]`` logits, float32 (model dtype with ``upcast=False``)."""
        ...

    @property
    def attention_layers(self) -> list[Attention]:
        """The paged attention layers, in layer order (one KV cache each)."""
        ...

    @property
    def num_attention_layers(self) -> int: ...

    def kv_cache_shape_per_layer(self, num_blocks: int, block_size: int) -> tuple[int, ...]: ...

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """One cache tensor per attention layer, in layer order; ``[]`` unbinds."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill the parameters from ``(checkpoint name, tensor)`` pairs; ValueError on a mismatch."""
        ...


MEMBERS = ("forward", "compute_logits", "attention_layers", "num_attention_layers", "kv_cache_shape_per_layer",
           "bind_kv_caches", "load_weights")
# A pooling model (runner "pooling": embeddings) is a CausalLM without the LM head: the runner pools
# its hidden states (``layers/pooler.py``) and never asks for logits. An encoder (BERT) has no paged
# attention layers at all (``attention_layers`` is empty): its prompt is computed in one step.
POOLING_MEMBERS = tuple(name for name in MEMBERS if name != "compute_logits")
INSTANCE_ATTRIBUTES = ("config", "max_supported_len")


def check_model_class(cls: type, runner: str = "generate") -> None:
    """Raise TypeError unless ``cls`` defines every method and property of ``CausalLM`` (of a
    pooling model with ``runner="pooling"``)."""
    members = POOLING_MEMBERS if runner == "pooling" else MEMBERS
    missing = [name for name in members if not hasattr(cls, name)]
    if missing:
        raise TypeError(f"model class {cls.__name__} lacks {', '.join(missing)} (models/interface.py: CausalLM)")


def check_model(model: object, runner: str = "generate") -> None:
    """Raise TypeError unless ``model`` provides the whole ``CausalLM`` interface (that of a pooling
    model with ``runner="pooling"``)."""
    check_model_class(type(model), runner)
    missing = [name for name in INSTANCE_ATTRIBUTES if not hasattr(model, name)]
    if missing or (runner != "pooling" and not isinstance(model, CausalLM)):
        raise TypeError(f"model {type(model).__name__} lacks {', '.join(missing) or 'a CausalLM member'} "
                        "(models/interface.py: CausalLM)")
