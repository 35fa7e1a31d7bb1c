"""The LoRA matrices of one linear layer: ``max_loras`` device slots of stacked A and B.

A layer computes one or several checkpoint projections (``qkv_proj`` = q, k, v; ``gate_up_proj`` =
gate, up: its slices). Slot ``s`` holds an adapter's matrices for all of them at once:

- ``lora_a [max_loras, n_slices * max_rank, in]``: slice ``i``'s A in rows ``i * max_rank ...``;
- ``lora_b [max_loras, out, n_slices * max_rank]``: slice ``i``'s B (scaled) in its output rows and
  the same columns, so B is block-diagonal and one shrink + one expand serve every slice.

A rank below ``max_rank`` and a slice the adapter does not target stay zero. Where the model's
norms were folded into this layer (``W[:, k] *= g[k]``, ``layers/compound.fold_norms``) the layer's
input is the unscaled row, so A is scaled the same way (``input_scale``) when a slot is written.
Cost: ``max_loras * n_slices * max_rank * (in + out)`` elements in the model dtype; per call with
adapters, one shrink and one expand (``punica.add_lora``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.lora.mapping import LoRABatchMapping
from pagedllm.lora.punica import add_lora


@dataclass
class LoRAStepState:
    """The step's token -> slot mapping, shared by every LoRA layer of a model; set by the manager
    only around a forward with adapters (``LoRAModelManager.step``), None otherwise."""

    mapping: LoRABatchMapping | None = None


class LoRALinearWeights:
    """See the module doc. ``slices``: ``(checkpoint projection name, first output row, rows)``."""

    def __init__(self, in_features: int, out_features: int, slices: list[tuple[str, int, int]], max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device, state: LoRAStepState) -> None:
        self.slices = slices
        self.max_rank = max_rank
        self.state = state
        width = len(slices) * max_rank
        self.lora_a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, out_features, width, dtype=dtype, device=device)
        self.input_scale: torch.Tensor | None = None  # a folded norm's weight (see the module doc)

    def slice_index(self, name: str) -> int | None:
        return next((i for i, s in enumerate(self.slices) if s[0] == name), None)

    @torch.no_grad()
    def set_slot(self, slot: int, matrices: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write slot ``slot``: ``matrices[i] = (A [r, in], B [out_i, r])`` for slice ``i`` (others zero)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for i, (a, b) in matrices.items():
            _, first_row, rows = self.slices[i]
            rank, col = a.shape[0], i * self.max_rank
            if self.input_scale is not None:  # on the device the norm weight lives on
                a = a.to(self.input_scale.device, torch.float32) * self.input_scale.float()[None, :]
            self.lora_a[slot, col : col + rank].copy_(a)
            self.lora_b[slot, first_row : first_row + rows, col : col + rank].copy_(b)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base layer's output for ``x``) plus each token's adapter delta, in place."""
        mapping = self.state.mapping
        assert mapping is not None, "a LoRA layer ran outside LoRAModelManager.step"
        if x.dim() != 2:
            return add_lora(y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), self.lora_a, self.lora_b,
                            mapping).view(y.shape)
        return add_lora(y, x, self.lora_a, self.lora_b, mapping)
