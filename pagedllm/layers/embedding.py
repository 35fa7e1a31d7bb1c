"""Token embedding and the LM head (optionally tied to the embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers import cpu_gemm, gemm_library, triton_ops
from pagedllm.layers.linear import default_weight_loader


class VocabEmbedding(nn.Module):
    """``[T] token ids -> [T, hidden]``."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """``[N, hidden] -> [N, vocab]`` logits in float32 (computed in the model dtype, then upcast, as HF;
    ``upcast=False`` leaves them in the model dtype).

    With ``tied_to`` the head shares the embedding's weight: one Parameter, loaded once.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
            self.weight.weight_loader = default_weight_loader
        self.cpu_packed_weight: torch.Tensor | None = None  # as in ``Linear``: the oneDNN-blocked copy

    def pack_cpu_weight(self) -> bool:
        """Prepack the head for the CPU (``cpu_gemm``): a tied head gets its own packed copy."""
        self.cpu_packed_weight = cpu_gemm.pack_weight(self.weight)
        return self.cpu_packed_weight is not None

    def forward(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Logits, upcast to float32 unless ``upcast=False`` (then in the model dtype: one kernel and
        a vocab-wide copy fewer per step, for a consumer that upcasts itself, like the sampler)."""
        if self.cpu_packed_weight is not None and hidden.device.type == "cpu" and hidden.dtype == self.weight.dtype:
            logits = cpu_gemm.packed_linear(hidden, self.cpu_packed_weight, None)
        elif triton_ops.use_skinny_lm_head(hidden, self.weight):
            logits = triton_ops.lm_head_linear(hidden, self.weight)
        else:
            logits = gemm_library.linear(hidden, self.weight)
        return logits.float() if upcast else logits
