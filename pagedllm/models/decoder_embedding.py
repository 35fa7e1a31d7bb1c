"""A decoder (Llama, Mistral, Qwen2, Qwen3) served as an embedding model (runner "pooling").

Qwen3-Embedding and its kind are causal decoders whose last token's final hidden state (after the
final norm) is the embedding. The decoder is ``models/llama.py``'s, unchanged; only the LM head is
absent, and checkpoints saved from the bare decoder (``Qwen3Model``: names without the ``model.``
prefix, no ``lm_head``) load as well as ``*ForCausalLM`` ones (whose ``lm_head.weight`` is then
unused and skipped).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.models.llama import LlamaForCausalLM, LlamaModel


class DecoderForEmbedding(LlamaForCausalLM):
    """``LlamaForCausalLM``'s decoder, KV-cache interface and weight loading, without an LM head:
    provides ``models/interface.py``'s pooling-model members (the runner pools ``forward``'s
    hidden states)."""

    def __init__(self, hf_config: Any) -> None:
        nn.Module.__init__(self)
        self.config = hf_config
        self.model = LlamaModel(hf_config)
        self.lm_head = _NoHead()
        self.max_supported_len: int | None = None  # sliding windows are attended, not capped

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        raise TypeError("compute_logits: an embedding model has no LM head (it is served with runner='pooling')")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``LlamaForCausalLM.load_weights`` over the decoder's names: a bare decoder's
        ``layers.N...`` become ``model.layers.N...``; ``lm_head.weight`` is dropped."""
        super().load_weights((name if name.startswith("model.") else f"model.{name}", tensor)
                             for name, tensor in weights if name != "lm_head.weight")


class _NoHead(nn.Module):
    """Stands where the LM head would be: no parameters; ``tied`` (what ``load_weights`` asks)
    is True so that a checkpoint's head is skipped."""

    tied = True
