"""Mixture-of-experts decoders on llama.py's layers: Mixtral, Qwen3-MoE and Qwen2-MoE, from the HF config.

A layer is llama.py's attention half (``LlamaAttention``: Qwen3-MoE's q/k norm and Qwen2-MoE's qkv
bias come from the config) and a ``SparseMoeBlock``: the router ``gate`` (a replicated linear, hidden
-> experts), the routed experts (``layers.FusedMoE``) and, for Qwen2-MoE, a shared expert (a dense
SiLU MLP) scaled by ``sigmoid(shared_expert_gate(x))``. Differences, all read from the config:

  - routing: Mixtral renormalises the top-k weights (so they are the softmax of the top-k logits);
    Qwen renormalises where ``norm_topk_prob``;
  - Qwen's ``mlp_only_layers`` and ``decoder_sparse_step`` make some layers dense (``LlamaMLP`` with
    ``intermediate_size``); the experts' size is ``moe_intermediate_size`` (Mixtral: ``intermediate_size``);
  - checkpoint names: Mixtral's ``block_sparse_moe.experts.N.w1 / w3 / w2`` (gate / up / down), Qwen's
    ``mlp.experts.N.gate_proj / up_proj / down_proj``, stacked at load into ``experts.w13_weight`` and
    ``experts.w2_weight`` (``MoeForCausalLM.checkpoint_target``).

Tensor parallel: attention and the shared expert as in llama.py; the experts split their
intermediate dim, or with ``enable_expert_parallel`` the experts themselves (``layers/fused_moe.py``).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagedllm.config import moe_sizes
from pagedllm.layers import (
    Linear,
    MergedLinear,
    ResidualState,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
)
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel

# model.layers.N.<block>.experts.E.<projection>.weight -> (the experts module, E, projection)
_EXPERT_WEIGHT = re.compile(r"^(model\.layers\.\d+\.\w+\.experts)\.(\d+)\.(\w+)\.weight$")
# Each checkpoint's name for an expert's gate, up and down projections.
EXPERT_PROJECTIONS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def is_sparse_layer(cfg: Any, index: int) -> bool:
    """Whether decoder layer ``index`` is an MoE layer (Mixtral: all; Qwen: as its modeling code decides)."""
    if cfg.model_type == "mixtral":
        return True
    return (index not in (getattr(cfg, "mlp_only_layers", None) or [])
            and (index + 1) % int(getattr(cfg, "decoder_sparse_step", 1) or 1) == 0)


class SharedExpertMLP(nn.Module):
    """Qwen2-MoE's shared expert: ``down(silu(gate(x)) * up(x))`` on every token (tensor-parallel as the
    dense MLP). Cost: two projections and one activation."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """(residual add +) post-attention norm -> router -> routed experts (+ gated shared expert), added
    to the residual state. The norm runs unfolded (it feeds the router and the experts), so the block
    works in both residual forms. Cost: the router GEMM (``[T, E]``), the fused experts (their
    all-reduce under tensor parallel) and, for Qwen2-MoE, the shared expert."""

    def __init__(self, cfg: Any, post_attention_layernorm: RMSNorm) -> None:
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        num_experts, expert_size = moe_sizes(cfg)
        renormalize = cfg.model_type == "mixtral" or bool(getattr(cfg, "norm_topk_prob", False))
        self.gate = Linear(cfg.hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, int(cfg.num_experts_per_tok), cfg.hidden_size, expert_size, renormalize)
        shared_size = int(getattr(cfg, "shared_expert_intermediate_size", None) or 0)
        self.shared_expert = SharedExpertMLP(cfg.hidden_size, shared_size) if shared_size else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1) if shared_size else None
        self._norm = (post_attention_layernorm,)  # the decoder layer's (registered there)

    def forward(self, state: ResidualState) -> ResidualState:
        x = _normed_input(state, self._norm[0])
        y = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if state.stream is not None:
            state.stream.add_(y)
        else:
            state.hidden = y
        return state


def _normed_input(state: ResidualState, norm: RMSNorm) -> torch.Tensor:
    """``norm(hidden + residual)`` of the residual state, updating it as ``NormLinear`` does (pair
    form: the new residual; stream form: the stream itself is the sum)."""
    if state.stream is not None:
        return norm(state.stream)
    if state.residual is None:
        x, state.residual = norm(state.hidden), state.hidden
    else:
        x, state.residual = norm(state.hidden, state.residual)
    state.hidden = None
    return x


class MoeDecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += moe_or_mlp(norm(h))``; the second half sits under its
    checkpoint name (Mixtral ``block_sparse_moe``, Qwen ``mlp``)."""

    def __init__(self, cfg: Any, rotary_emb: RotaryEmbedding, index: int) -> None:
        super().__init__()
        input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary_emb, input_layernorm)
        sparse = is_sparse_layer(cfg, index)
        ffn = SparseMoeBlock(cfg, post_attention_layernorm) if sparse else LlamaMLP(cfg, post_attention_layernorm)
        setattr(self, "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp", ffn)
        self._ffn = (ffn,)
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def forward(self, positions: torch.Tensor, state: ResidualState) -> ResidualState:
        return self._ffn[0](self.self_attn(positions, state))


class MoeModel(LlamaModel):
    """``LlamaModel`` with ``MoeDecoderLayer`` layers."""

    def make_layer(self, cfg: Any, index: int) -> nn.Module:
        return MoeDecoderLayer(cfg, self.rotary_emb, index)


class MoeForCausalLM(LlamaForCausalLM):
    """The causal LM of Mixtral, Qwen3-MoE and Qwen2-MoE (``models/interface.CausalLM``, as
    ``LlamaForCausalLM``). Quantized weights are refused (``supports_quantization``): the experts
    have no quantized form yet."""

    model_class = MoeModel
    supports_quantization = False

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """An expert's projection -> ``(experts.w13_weight | experts.w2_weight, (expert, role))``;
        everything else as llama.py."""
        match = _EXPERT_WEIGHT.match(name)
        if match is not None and match.group(3) in EXPERT_PROJECTIONS:
            experts, expert, projection = match.groups()
            role = EXPERT_PROJECTIONS[projection]
            return f"{experts}.{'w2_weight' if role == 'down' else 'w13_weight'}", (int(expert), role)
        return super().checkpoint_target(name)
