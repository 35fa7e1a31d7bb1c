"""Fusions as modules: an op and the linear layer next to it, composed by a model.

Each compound module holds references to the model's own modules (registered elsewhere under their
checkpoint names; a compound module owns no parameters) and computes exactly what calling them one
after the other computes. Where a kernel runs both in one launch, it asks the linear layer for it
through one of the layer's fused methods (``Linear.forward_norm_prologue``, ``forward_act_prologue``,
``forward_add_``, ``QKVLinear.forward_norm_rope_store``), which return None where their kernel does
not apply (another device or shape, or a linear subclass that says ``fuses_kernels = False``); the
compound module then calls the plain modules. So a LoRA or quantized linear is never bypassed.

- ``NormLinear``: residual add + RMSNorm + projection (qkv_proj, gate_up_proj); at 1-2 decode rows
  on CUDA one GEMV with the norm in its prologue; in the stream form the projection of the stream
  with the norm left pending as a row scale. ``fold_norm`` is its load-time weight transform.
- ``RopeKVWrite``: (q/k norm +) RoPE of q and k + the K/V store through the attention layer's
  writer (``Attention.fused_kv_store``): one launch on CUDA, which also applies a pending row scale.
- ``NormQKVRope``: ``NormLinear`` then ``RopeKVWrite``; at one token row in the pair form (models
  without a q/k norm) all of it in one launch.
- ``SiluAndMulLinear``: SiLU-and-mul + projection (down_proj), output added to the residual state;
  at 1-2 decode rows on CUDA one GEMV with the activation in its prologue.
- ``LinearAdd``: an output projection (o_proj) added to the residual state: in the stream form the
  add runs in the GEMM's epilogue.

The residual state (``layers/residual.py``) says which form a forward runs in; the compound modules
are the only code that looks. Invariant: every path gives the unfused result up to float32
summation order and, after a norm, one rounding of the normed row (which the fused GEMVs never
round); the stream form differs from the pair form by the rounding of the folded weights.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import Linear, QKVLinear
from pagedllm.layers.norm import RMSNorm, rms_scale
from pagedllm.layers.residual import ResidualForm, ResidualState
from pagedllm.layers.rotary import RotaryEmbedding


class AttentionInputs(NamedTuple):
    """What ``Attention.forward`` takes: ``q [T, H*D]``; ``k``/``v`` ``[T, Hkv*D]`` or None once the
    K/V store ran (``kv_stored``)."""

    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    kv_stored: bool


class NormLinear(nn.Module):
    """``linear(norm(hidden + residual))`` from a ``ResidualState``, which it updates (pair form: the
    new residual; stream form: the pending row scale). Cost on CUDA at 1-2 rows where the linear
    takes the Triton GEMV: one launch; elsewhere the norm launch and the GEMM (no norm launch in the
    stream form)."""

    def __init__(self, norm: RMSNorm, linear: Linear) -> None:
        super().__init__()
        self._parts = (norm, linear)  # the model's modules (not registered here: no second name)

    @property
    def norm(self) -> RMSNorm:
        return self._parts[0]

    @property
    def linear(self) -> Linear:
        return self._parts[1]

    def forward(self, state: ResidualState) -> torch.Tensor:
        norm, linear = self._parts
        if state.stream is not None:
            state.row_scale = (state.stream, norm.eps)
            return linear(state.stream)
        fused = linear.forward_norm_prologue(state.hidden, state.residual, norm)
        if fused is not None:
            y, state.residual = fused
        elif state.residual is None:
            y, state.residual = linear(norm(state.hidden)), state.hidden
        else:
            normed, state.residual = norm(state.hidden, state.residual)
            y = linear(normed)
        state.hidden = None
        return y

    def can_fold_norm(self) -> bool:
        return self.linear.can_fold_input_scale() and self.norm.fuses_kernels

    @torch.no_grad()
    def fold_norm(self) -> None:
        """Move the norm's weight into the projection: ``W[:, k] *= g[k]`` (float32, rounded to W's
        dtype), then ``g = 1``. The module computes the same function up to that rounding of W.
        Precondition: ``can_fold_norm()``, and the norm feeds no other module."""
        self.linear.fold_input_scale_(self.norm.weight)
        self.norm.weight.fill_(1.0)


class RopeKVWrite(nn.Module):
    """``AttentionInputs`` from a qkv projection's output ``[T, q + 2 kv]``: (q/k norm +) RoPE of q and
    k, and on CUDA the K/V store in the same launch (``RotaryEmbedding.forward_and_store``, through
    ``Attention.fused_kv_store``); a pending ``row_scale = (s, eps)`` first scales each row by
    ``1 / rms(s_row)``. q, k and v stay views of the projection's output where no kernel copies them."""

    def __init__(self, rotary_emb: RotaryEmbedding, attn: Attention, q_norm: RMSNorm | None = None,
                 k_norm: RMSNorm | None = None) -> None:
        super().__init__()
        self._parts = (rotary_emb, attn, q_norm, k_norm)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor,
                row_scale: tuple[torch.Tensor, float] | None = None) -> AttentionInputs:
        rotary_emb, attn, q_norm, k_norm = self._parts
        num_tokens = qkv.shape[0]
        q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, attn.num_heads, attn.head_dim)
        k = k.view(num_tokens, attn.num_kv_heads, attn.head_dim)
        kv_store = attn.fused_kv_store(v)
        if kv_store is not None:  # on CUDA: (scale,) rotate and store K/V in one launch
            q_rot = rotary_emb.forward_and_store(positions, q, k, q_norm, k_norm, kv_store, row_scale)
            if q_rot is not None:
                return AttentionInputs(q_rot.reshape(num_tokens, q_size), None, v, True)
        if row_scale is not None:
            return self(positions, rms_scale(qkv, *row_scale))
        q, k = rotary_emb(positions, q, k, q_norm, k_norm)
        return AttentionInputs(q.reshape(num_tokens, q_size), k.reshape(num_tokens, kv_size), v, False)


class NormQKVRope(nn.Module):
    """(residual add +) input norm -> qkv projection -> (q/k norm +) RoPE -> K/V store, from a
    ``ResidualState``. At one token row in the pair form without a q/k norm, where the qkv GEMV is
    fused and the attention backend takes stored K/V, all of it is one launch
    (``QKVLinear.forward_norm_rope_store``); else ``NormLinear`` then ``RopeKVWrite``."""

    def __init__(self, norm: RMSNorm, qkv_proj: QKVLinear, rotary_emb: RotaryEmbedding, attn: Attention,
                 q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> None:
        super().__init__()
        self.norm_qkv = NormLinear(norm, qkv_proj)
        self.rope_write = RopeKVWrite(rotary_emb, attn, q_norm, k_norm)
        self._parts = (norm, qkv_proj, rotary_emb, attn)
        self._one_launch = q_norm is None and rotary_emb.rotary_dim == attn.head_dim

    def forward(self, positions: torch.Tensor, state: ResidualState) -> AttentionInputs:
        if self._one_launch and state.stream is None and state.hidden.shape[0] == 1:
            fused = self._norm_qkv_rope_store(positions, state)
            if fused is not None:
                return fused
        return self.rope_write(positions, self.norm_qkv(state), state.take_row_scale())

    def _norm_qkv_rope_store(self, positions: torch.Tensor, state: ResidualState) -> AttentionInputs | None:
        norm, qkv_proj, rotary_emb, attn = self._parts
        target = attn.kv_store_target()
        if target is None:
            return None
        fused = qkv_proj.forward_norm_rope_store(state.hidden, state.residual, norm, positions,
                                                 rotary_emb.cos_cache, rotary_emb.sin_cache, *target)
        if fused is None:
            return None
        q_rot, state.residual = fused
        state.hidden = None
        return AttentionInputs(q_rot, None, None, True)


class LinearAdd(nn.Module):
    """``residual_state += linear(x)``: a sublayer's output projection. Stream form: one GEMM with the
    add in its epilogue, in place (``Linear.forward_add_``). Pair form: the output becomes the
    state's ``hidden`` and the next norm adds it (inside its own launch)."""

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        self._parts = (linear,)

    def forward(self, x: torch.Tensor, state: ResidualState) -> ResidualState:
        (linear,) = self._parts
        if state.stream is not None:
            linear.forward_add_(x, state.stream)
        else:
            state.hidden = linear(x)
        return state


class SiluAndMulLinear(nn.Module):
    """``residual_state += linear(silu(gate) * up)`` for ``x = [gate | up]``, applying a pending row
    scale first (stream form, inside the activation's launch on CUDA). Pair form at 1-2 rows where
    the linear takes the Triton GEMV: one launch (the activation in its prologue)."""

    def __init__(self, act: SiluAndMul, linear: Linear) -> None:
        super().__init__()
        self._parts = (act, linear)
        self.output = LinearAdd(linear)

    def forward(self, x: torch.Tensor, state: ResidualState) -> ResidualState:
        act, linear = self._parts
        if state.stream is None and act.fuses_kernels:
            y = linear.forward_act_prologue(x)
            if y is not None:
                state.hidden = y
                return state
        return self.output(act(x, state.take_row_scale()), state)


def fold_norms(model: nn.Module) -> bool:
    """Fold every ``NormLinear``'s norm into its projection (``NormLinear.fold_norm``) if all of them
    can be (no biases, plain linears); else fold nothing and return False. Folding alone changes no
    result beyond the rounding of W; ``ResidualForm.use_stream_from`` may then enable the stream form."""
    pairs = [m for m in model.modules() if isinstance(m, NormLinear)]
    if not pairs or not all(p.can_fold_norm() for p in pairs):
        return False
    for pair in pairs:
        pair.fold_norm()
    return True


def use_residual_stream(model: nn.Module, min_tokens: int | None) -> None:
    """Every ``ResidualForm`` of ``model`` takes the stream form from ``min_tokens`` rows (None: never)."""
    for module in model.modules():
        if isinstance(module, ResidualForm):
            module.use_stream_from(min_tokens)
