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

The shrink's float32 output (``[T, n_slices * max_rank]``, summed atomically: it must start at
zero) is, on CUDA, a column range of the step's workspace (``LoRAStepState.workspace``: every LoRA
layer of the model side by side, zeroed once at the start of each forward with adapters), so a
layer launches its two kernels and nothing else; a step with more tokens than the workspace has
rows (a long prefill) lets the shrink allocate its own zeroed buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.lora.mapping import LoRABatchMapping
from pagedllm.lora.punica import add_lora


@dataclass
class LoRAStepState:
    """What every LoRA layer of a model shares in a forward: the step's token -> slot mapping, set
    by the manager only around a forward with adapters (``LoRAModelManager.step``), None otherwise;
    and the shrink workspace (float32 ``[rows, sum of the layers' widths]``, CUDA only, else None)
    with ``zeroed_rows``, how many of its first rows the current forward zeroed (0: none; layers
    use it only for that many tokens)."""

    mapping: LoRABatchMapping | None = None
    workspace: torch.Tensor | None = None
    zeroed_rows: int = 0


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
        self.slice_starts = tuple(first_row for _, first_row, _ in slices)
        self.workspace_col = 0  # this layer's first column in ``state.workspace`` (the manager sets it)

    @property
    def width(self) -> int:
        """The stacked rank: columns of the shrunk rows (``n_slices * max_rank``)."""
        return self.lora_a.shape[1]

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
        state = self.state
        assert state.mapping is not None, "a LoRA layer ran outside LoRAModelManager.step"
        rows, out = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        shrunk = None
        if state.workspace is not None and rows.shape[0] <= state.zeroed_rows:
            shrunk = state.workspace[: rows.shape[0], self.workspace_col : self.workspace_col + self.width]
        add_lora(out, rows, self.lora_a, self.lora_b, state.mapping, self.slice_starts, self.max_rank, shrunk)
        return y
