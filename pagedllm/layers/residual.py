"""How the residual stream travels between a decoder's sublayers: the pair form or the stream form.

A pre-norm block computes ``h = h + f(norm(h))`` twice per layer. Two forms compute the same thing:

- pair form: ``(hidden, residual)``: ``hidden`` is the last sublayer's output, not yet added;
  the next norm adds it to ``residual`` (inside its kernel, or inside the next decode GEMV's
  prologue at 1-2 rows), so a layer has no separate residual adds. ``residual`` is None before the
  first add (the stream starts as ``hidden``).
- stream form (the norms' weights folded into the projections after them,
  ``compound.fold_norms``): only the stream is carried. A norm + projection reads the stream itself
  and leaves the norm's ``1 / rms(stream)`` as a pending row scale, which the op after the
  projection applies (the RoPE + KV-store launch, the SiLU-and-mul launch); each sublayer's output
  projection adds into the stream in its GEMM epilogue, in place. No norm launches in a layer.

``ResidualForm`` (a module of the model) chooses the form at the start of each forward: the stream
form only where ``prepare_model_kernels`` enabled it (norms folded, the fused CUDA kernels on) and
the step has at least ``stream_min_tokens`` rows (below that the decode GEMVs fuse the norms into
their prologues, and the narrow projections are GEMVs without an add epilogue). The compound modules
of ``layers/compound.py`` accept the ``ResidualState`` it returns and hide the difference.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.norm import RMSNorm


class ResidualState:
    """The residual stream of one forward, in one of the two forms (module doc).

    Pair form: ``stream`` is None; ``hidden`` and ``residual`` as described there. Stream form:
    ``stream`` is the running sum ``[T, hidden]`` (updated in place; it starts as the embedding
    output, a tensor nothing else holds), and ``row_scale`` is the pending ``(stream, eps)`` of the
    last folded norm, or None. Cost: a Python object per forward, no tensors of its own."""

    __slots__ = ("hidden", "residual", "stream", "row_scale")

    def __init__(self, hidden: torch.Tensor | None, stream: torch.Tensor | None = None) -> None:
        self.hidden = hidden
        self.residual: torch.Tensor | None = None
        self.stream = stream
        self.row_scale: tuple[torch.Tensor, float] | None = None

    @property
    def is_stream(self) -> bool:
        return self.stream is not None

    def take_row_scale(self) -> tuple[torch.Tensor, float] | None:
        """The pending norm's ``(stream, eps)`` (stream form), cleared; None in the pair form."""
        row_scale, self.row_scale = self.row_scale, None
        return row_scale

    def normed(self, norm: RMSNorm) -> torch.Tensor:
        """The final ``norm`` of the stream (the model's last norm, never folded)."""
        if self.stream is not None:
            return norm(self.stream)
        if self.residual is None:
            return norm(self.hidden)
        return norm(self.hidden, self.residual)[0]


class ResidualForm(nn.Module):
    """``forward(hidden [T, H]) -> ResidualState``: the stream form from ``stream_min_tokens`` rows
    once ``use_stream_from`` enabled it (norms folded), else the pair form. No parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.stream_min_tokens: int | None = None  # None: always the pair form

    def use_stream_from(self, min_tokens: int | None) -> None:
        """Take the stream form from ``min_tokens`` rows (None: never). Only valid while every norm
        before a projection is folded into it (``compound.fold_norms``)."""
        self.stream_min_tokens = min_tokens

    def forward(self, hidden: torch.Tensor) -> ResidualState:
        if self.stream_min_tokens is not None and hidden.dim() == 2 and hidden.shape[0] >= self.stream_min_tokens:
            return ResidualState(None, stream=hidden)
        return ResidualState(hidden)

    def extra_repr(self) -> str:
        return f"stream_min_tokens={self.stream_min_tokens}"
