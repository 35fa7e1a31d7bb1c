"""Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 text (``Gemma3ForCausalLM``, model_type "gemma3_text").

One decoder for both, driven by the HF config; it shares the Llama model's layers, KV-cache
methods and checkpoint loading (``LlamaForCausalLM``, whose layout it keeps). What Gemma adds:
  - sandwich norms: ``h += post_attention_norm(attn(input_norm(h)))`` then
    ``h += post_feedforward_norm(mlp(pre_feedforward_norm(h)))``;
  - RMSNorm scales by ``1 + weight``: the checkpoint's norm weights are stored plus one at load,
    so the shared ``RMSNorm`` (``weight * normed``) computes it (exact in float32; in half
    precision ``1 + w`` is rounded once to the weight dtype, where HF multiplies in float32);
  - the embedding is multiplied by ``sqrt(hidden_size)`` (rounded to the model dtype, as HF does);
  - a GELU-tanh gated MLP; attention scaled by ``query_pre_attn_scalar ** -0.5``;
  - soft-capping: of attention scores (``attn_logit_softcapping``, Gemma 2; every attention
    backend applies it) and of the final logits (``final_logit_softcapping``);
  - interleaved local and global layers (``layer_types``): local layers attend over
    ``sliding_window`` keys. The global layers read the whole context, so a request keeps every KV
    block (no block is freed as the window moves, unlike Mistral's: ``core/kv_cache_manager.py``);
  - Gemma 3: q/k RMSNorm per head, and RoPE per layer type (``rope_parameters`` keyed by
    "sliding_attention" / "full_attention": another theta, and scaling, for the global layers).
The pair of ops ``LlamaForCausalLM`` fuses on CUDA (norm + projection, residual forms) does not
apply to the sandwich norms: the norms run as their own ops; RoPE and the K/V store still fuse.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.distributed import get_pp_group
from pagedllm.layers import (
    Attention,
    GeluTanhAndMul,
    LMHead,
    MergedLinear,
    QKVLinear,
    RMSNorm,
    RopeKVWrite,
    RotaryEmbedding,
    RowParallelLinear,
    VocabEmbedding,
)
from pagedllm.loader.architectures import layer_sliding_windows
from pagedllm.models.llama import LlamaForCausalLM, OtherStageLayer, head_dim_of

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


class GemmaAttention(nn.Module):
    """qkv projection -> (q/k norm +) RoPE (+ K/V store on CUDA) -> paged attention -> o_proj."""

    def __init__(self, cfg: Any, rotary_emb: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__()
        head_dim = head_dim_of(cfg)
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = QKVLinear(cfg.hidden_size, head_dim, cfg.num_attention_heads, num_kv_heads, bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = self.k_norm = None
        if cfg.model_type == "gemma3_text":
            self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps)
        self.rotary_emb = rotary_emb
        scale = float(cfg.query_pre_attn_scalar) ** -0.5
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, scale, self.qkv_proj.num_kv_heads, sliding_window,
                              getattr(cfg, "attn_logit_softcapping", None))
        self.rope_write = RopeKVWrite(rotary_emb, self.attn, self.q_norm, self.k_norm)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attn(*self.rope_write(positions, self.qkv_proj(x))))


class GemmaMLP(nn.Module):
    """``down(gelu_tanh(gate) * up)``."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        if act not in _GELU_TANH:
            raise ValueError(f"hidden_activation {act!r} is not supported (only {', '.join(_GELU_TANH)})")
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)
        self.act = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """The sandwich-norm block (module doc) on ``(hidden, residual)``: ``hidden`` is the last
    sublayer's normed output, not yet added to ``residual`` (None before the first layer, where
    ``hidden`` is the stream); the next norm adds them in its own launch."""

    def __init__(self, cfg: Any, rotary_emb: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(cfg, rotary_emb, sliding_window)
        self.mlp = GemmaMLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(hidden), hidden
        else:
            x, residual = self.input_layernorm(hidden, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    """Scaled embedding -> decoder layers -> final norm, with pipeline stages as ``LlamaModel``'s
    (a stage returns its residual stream for the next). The RoPE tables: one shared by every layer,
    or with per-layer-type RoPE parameters (Gemma 3) one per layer type."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported (causal decoders only)")
        self.pp = get_pp_group()
        self.layer_range = self.pp.layer_range(cfg.num_hidden_layers)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        # HF multiplies by sqrt(hidden_size) rounded to the model dtype (the default dtype here).
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5, dtype=torch.get_default_dtype()))
        head_dim = head_dim_of(cfg)
        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        rope = getattr(cfg, "rope_parameters", None) or {}
        per_type = all(isinstance(rope.get(t), dict) for t in set(layer_types))
        tables = {t: RotaryEmbedding(cfg, head_dim, cfg.max_position_embeddings, layer_type=t if per_type else None)
                  for t in (sorted(set(layer_types)) if per_type else ["all"])}
        self.rotary_embs = nn.ModuleDict(tables)  # shared by the layers of each type
        windows = layer_sliding_windows(cfg)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, tables[layer_types[i] if per_type else "all"], windows[i])
            if i in self.layer_range else OtherStageLayer() for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embed_scale if self.pp.is_first else intermediate
        residual = None
        for i in self.layer_range:
            hidden, residual = self.layers[i](positions, hidden, residual)
        if not self.pp.is_last:
            return hidden if residual is None else hidden + residual
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text (module doc): ``LlamaForCausalLM``'s interface over ``GemmaModel``,
    with the final logit soft cap and the ``1 + weight`` norms stored at load."""

    def __init__(self, hf_config: Any) -> None:
        nn.Module.__init__(self)
        self.config = hf_config
        self.model = GemmaModel(hf_config)
        tied = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head = LMHead(hf_config.vocab_size, hf_config.hidden_size, self.model.embed_tokens if tied else None)
        self.max_supported_len: int | None = None
        self.final_logit_softcapping: float | None = getattr(hf_config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """``[N, vocab]`` logits, soft-capped by ``final_logit_softcapping`` where set: ``c * tanh(x / c)``."""
        logits = self.lm_head(hidden, upcast)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Every RMSNorm weight ``w`` of the checkpoint as ``1 + w`` (float32 sum; module doc)."""
        for name, tensor in weights:
            yield name, (tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)


class Gemma2ForCausalLM(GemmaForCausalLM):
    """HF ``Gemma2ForCausalLM`` (model_type "gemma2")."""


class Gemma3ForCausalLM(GemmaForCausalLM):
    """HF ``Gemma3ForCausalLM``, text only (model_type "gemma3_text")."""
