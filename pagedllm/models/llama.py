"""One decoder for Llama (incl. SmolLM2), Mistral, Qwen2 and Qwen3, driven by the HF config.

Differences between the four, all read from the config:
  - Qwen2: bias on q/k/v (not on o_proj).
  - Qwen3: RMSNorm over each head of q and k (``q_norm``/``k_norm``) before RoPE; ``head_dim`` may
    differ from hidden_size / num_heads.
  - Llama: ``attention_bias`` (q/k/v/o) and ``mlp_bias`` flags; llama3 RoPE scaling.
  - Mistral / Qwen sliding window: not implemented. When a config turns it on, the model reports
    ``max_supported_len = sliding_window``; the engine caps ``max_model_len`` to it, and below the
    window sliding-window attention *is* full causal attention, so results stay exact.

Tokens are flattened (no batch dim): ``forward(input_ids [T], positions [T]) -> hidden [T, hidden]``.
Attention goes only through ``layers.Attention`` (the paged backend from the forward context).
Module names mirror HF's (``model.layers.N.self_attn...``) so checkpoint names map one to one,
except the merged ``qkv_proj`` and ``gate_up_proj`` (see ``STACKED_PARAMS``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.layers import (
    Attention,
    Linear,
    LMHead,
    MergedLinear,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    VocabEmbedding,
    default_weight_loader,
    fused_norm_linear,
    fused_norm_qkv_rope,
    fused_silu_and_mul_linear,
    get_rope_parameters,
    rms_scale,
    triton_ops,
)

# (checkpoint name fragment, our merged parameter fragment, shard id)
STACKED_PARAMS = [
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
]
# Checkpoint entries that are not weights (older HF checkpoints saved the RoPE buffer).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def head_dim_of(cfg: Any) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def sliding_window_of(cfg: Any) -> int | None:
    """The sliding window the config turns on, or None (Qwen configs carry one that is off unless
    ``use_sliding_window``)."""
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return None
    return int(window)


class LlamaAttention(nn.Module):
    """(residual add +) input norm -> qkv projection -> (q/k norm +) RoPE -> paged attention -> o_proj.

    Cost on CUDA: the norm launch and 2 GEMMs (at decode batch 1-2 the norm runs inside the qkv GEMV
    where that is the Triton GEMV: ``layers.fused``), one launch for the q/k norm + RoPE that also
    writes k and v into the KV cache (``RotaryEmbedding.forward_and_store``), and the attention
    backend's launches; q/k/v stay views of the merged qkv output (no copies). At batch 1 without a
    q/k norm (Llama, Qwen2) norm, qkv, RoPE and the KV store are one launch (``fused_norm_qkv_rope``).
    In the residual-stream form (``forward_stream``, 3+ tokens on CUDA with the norms folded) there
    is no norm launch: qkv GEMM, one RoPE + KV-store launch that also applies the norm's row scale,
    the attention, and the o_proj GEMM that adds into the stream.
    ``rotary_emb`` is the model's one shared table (a submodule of every layer, stored once).
    """

    def __init__(self, cfg: Any, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(cfg)
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias = attention_bias or cfg.model_type == "qwen2"
        self.qkv_proj = QKVLinear(cfg.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=attention_bias)
        self.q_norm = self.k_norm = None
        if cfg.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm`` (the layer's input norm) adds ``residual`` to ``hidden`` and normalises the sum;
        returns ``(o_proj output, new residual)``."""
        if self.q_norm is None:  # at decode batch 1 on CUDA: norm + qkv + RoPE + KV store in one launch
            fused = fused_norm_qkv_rope(norm, self.qkv_proj, self.rotary_emb, self.attn, hidden, residual, positions)
            if fused is not None:
                q_rot, residual = fused
                return self.o_proj(self.attn(q_rot, None, None, kv_stored=True)), residual
        qkv, residual = fused_norm_linear(norm, self.qkv_proj, hidden, residual)
        return self.o_proj(self._attend(positions, qkv)), residual

    def forward_stream(self, positions: torch.Tensor, stream: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """The residual-stream form of ``forward`` (``LlamaModel.forward`` says when it runs): ``norm``'s
        weight is folded into ``qkv_proj`` (``LlamaForCausalLM.fold_norms``), so the projection reads
        the stream itself and each token's ``1 / rms(stream)`` scales q, k and v after it (inside the
        RoPE + KV-store launch on CUDA); o_proj adds its output to the stream in the same GEMM.
        Updates ``stream`` in place and returns it."""
        return self.o_proj.forward_add_(self._attend(positions, self.qkv_proj(stream), (stream, norm.eps)), stream)

    def _attend(self, positions: torch.Tensor, qkv: torch.Tensor,
                row_scale: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """(q/k norm +) RoPE, KV store and attention of a qkv projection's output ``[T, q + 2 kv]``;
        ``row_scale = (s, eps)`` first scales each row by ``1 / rms(s_row)`` (``rms_scale``)."""
        num_tokens = qkv.shape[0]
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        kv_store = self.attn.fused_kv_store(v)
        if kv_store is not None:  # on CUDA: (scale,) rotate and store K/V in one launch
            q_rot = self.rotary_emb.forward_and_store(positions, q, k, self.q_norm, self.k_norm, kv_store, row_scale)
            if q_rot is not None:
                return self.attn(q_rot.reshape(num_tokens, q_size), None, v, kv_stored=True)
        if row_scale is not None:
            return self._attend(positions, rms_scale(qkv, *row_scale))
        q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm)
        return self.attn(q.reshape(num_tokens, q_size), k.reshape(num_tokens, kv_size), v)


class LlamaMLP(nn.Module):
    """(residual add +) post-attention norm -> ``down(silu(gate) * up)``.

    Cost on CUDA: the norm launch, 2 GEMMs and one fused activation launch; at decode batch 1-2 the
    norm runs inside the gate_up GEMV and the activation inside the down GEMV wherever those are the
    Triton GEMV (``layers.fused``), down to 2 launches. In the residual-stream form
    (``forward_stream``) 3 launches: gate_up GEMM, SiLU-and-mul with the norm's row scale, and the
    down GEMM that adds into the stream.
    """

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        bias = bool(getattr(cfg, "mlp_bias", False))
        size = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [size, size], bias=bias)
        self.down_proj = Linear(size, cfg.hidden_size, bias=bias)
        self.act = SiluAndMul()

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm`` (the layer's post-attention norm) adds ``residual`` to ``hidden`` and normalises
        the sum; returns ``(down_proj output, new residual)``."""
        gate_up, residual = fused_norm_linear(norm, self.gate_up_proj, hidden, residual)
        return fused_silu_and_mul_linear(self.act, self.down_proj, gate_up), residual

    def forward_stream(self, stream: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """The residual-stream form of ``forward`` (see ``LlamaAttention.forward_stream``): gate_up
        reads the stream (``norm``'s weight folded into it), the SiLU-and-mul launch applies each
        row's ``1 / rms(stream)``, and down_proj adds its output to the stream in the same GEMM
        (in place)."""
        act = self.act(self.gate_up_proj(stream), (stream, norm.eps))
        return self.down_proj.forward_add_(act, stream)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary_emb)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block; the residual stream travels beside ``hidden`` and is added inside the norms
        (one fused launch each on CUDA, or inside the next GEMV at decode batch 1-2), so a layer has
        no separate residual adds. ``residual`` is None in the first layer (the stream starts as
        ``hidden``)."""
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm)
        return self.mlp(hidden, residual, self.post_attention_layernorm)

    def forward_stream(self, positions: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        """The same block on the residual stream alone (norms folded; ``LlamaModel.forward``),
        updated in place."""
        stream = self.self_attn.forward_stream(positions, stream, self.input_layernorm)
        return self.mlp.forward_stream(stream, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        head_dim = head_dim_of(cfg)
        rotary_dim = int(head_dim * get_rope_parameters(cfg).get("partial_rotary_factor", 1.0))
        self.rotary_emb = RotaryEmbedding(cfg, head_dim, cfg.max_position_embeddings, rotary_dim)  # shared
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, self.rotary_emb) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The layers' norm weights live in the projections after them (``LlamaForCausalLM.fold_norms``).
        self.norms_folded = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Two forms of the same function. Residual stream (norms folded, CUDA, from
        ``triton_ops.RESIDUAL_STREAM_MIN_TOKENS`` tokens): the stream is the only activation carried
        between blocks; each norm is applied after the projection it feeds (a row scale inside the
        RoPE and SiLU-and-mul launches) and each block's last GEMM adds its output to the stream in
        its epilogue, in place (the stream starts as the embedding output, a new tensor), so a layer
        has no norm launches (7 launches per layer instead of 9).
        Otherwise the residual travels beside ``hidden`` and is added inside the norms (or inside
        the decode GEMVs at 1-2 tokens)."""
        hidden = self.embed_tokens(input_ids)
        if self.norms_folded and triton_ops.use_residual_stream(hidden):
            for layer in self.layers:
                hidden = layer.forward_stream(positions, hidden)
            return self.norm(hidden)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """The causal LM. Public surface used by the runner:

    - ``forward(input_ids [T], positions [T]) -> hidden [T, hidden_size]`` (inside ``forward_context``)
    - ``compute_logits(hidden [N, hidden_size], upcast=True) -> [N, vocab_size]`` float32 (model dtype
      with ``upcast=False``)
    - ``num_attention_layers``, ``kv_cache_shape_per_layer(num_blocks, block_size)``,
      ``bind_kv_caches(caches)``, ``max_supported_len`` (None or the sliding window; see module doc)
    - ``load_weights(iterable of (HF name, tensor))``
    """

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.config = hf_config
        self.model = LlamaModel(hf_config)
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = LMHead(hf_config.vocab_size, hf_config.hidden_size, self.model.embed_tokens if tied else None)
        self.max_supported_len: int | None = sliding_window_of(hf_config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """``[N, vocab]`` logits, float32 (or in the model dtype with ``upcast=False``)."""
        return self.lm_head(hidden, upcast)

    # ---- KV cache -------------------------------------------------------------------------------
    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @property
    def num_attention_layers(self) -> int:
        return len(self.model.layers)

    def kv_cache_shape_per_layer(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return self.attention_layers[0].kv_cache_shape(num_blocks, block_size)

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Give each Attention layer its cache tensor (one per layer, in layer order); ``[]`` unbinds
        (every layer gets an empty tensor again, e.g. after a memory-profiling run)."""
        layers = self.attention_layers
        if not kv_caches:
            for attn in layers:
                attn.kv_cache = torch.empty(0, device=attn.kv_cache.device)
            return
        if len(kv_caches) != len(layers):
            raise ValueError(f"bind_kv_caches: got {len(kv_caches)} caches for {len(layers)} attention layers")
        for attn, cache in zip(layers, kv_caches):
            if cache.dim() != 5 or cache.shape[0] != 2 or tuple(cache.shape[3:]) != (attn.num_kv_heads, attn.head_dim):
                raise ValueError(f"bind_kv_caches: cache shape {tuple(cache.shape)} is not "
                                 f"[2, num_blocks, block_size, {attn.num_kv_heads}, {attn.head_dim}]")
            attn.kv_cache = cache

    # ---- weights ------------------------------------------------------------------------------
    @torch.no_grad()
    def fold_norms(self) -> bool:
        """Move every decoder layer's RMSNorm weight into the projection it feeds: ``W[:, k] *= g[k]``
        for qkv_proj (input_layernorm) and gate_up_proj (post_attention_layernorm), in float32 and
        rounded to W's dtype, then ``g = 1``. The model computes the same function (up to that one
        rounding of W: bf16 relative 2^-9) on every path; it is what lets the residual-stream
        forward (``LlamaModel.forward``) apply the norms after the projections. The final norm stays
        (the LM head may be the tied embedding). Returns False, folding nothing, for models with a
        bias on any projection (the scale would have to go between the product and the bias).
        ``load_weights`` undoes it (the checkpoint's values come back): fold again after loading."""
        layers = list(self.model.layers)
        linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if any(linear.bias is not None for linear in linears):
            return False
        for layer in layers:
            for norm, linear in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                                 (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
                linear.weight.copy_(linear.weight.float() * norm.weight.float()[None, :])
                norm.weight.fill_(1.0)
        self.model.norms_folded = True
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into our parameters; raise ValueError naming every missing
        or unexpected weight. A tied model ignores a checkpoint's ``lm_head.weight`` (HF saves it
        sometimes); ``rotary_emb.inv_freq`` entries are ignored."""
        self.model.norms_folded = False  # the checkpoint's norm weights come back
        params = dict(self.named_parameters())  # a tied lm_head appears once, as model.embed_tokens.weight
        loaded: set[tuple[str, object]] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith(IGNORED_SUFFIXES) or (self.lm_head.tied and name == "lm_head.weight"):
                continue
            target, shard_id = name, None
            for ckpt_part, our_part, shard in STACKED_PARAMS:
                if ckpt_part in name:
                    target, shard_id = name.replace(ckpt_part, our_part), shard
                    break
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            try:
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"checkpoint weight {name!r}: {e}") from e
            shards = getattr(param, "shard_ids", (None,)) if shard_id is None else (shard_id,)
            loaded.update((target, s) for s in shards)
        expected = {(n, s) for n, p in params.items() for s in getattr(p, "shard_ids", (None,))}
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
        if missing or unexpected:
            arch = f"{type(self).__name__} (model_type={self.config.model_type!r})"
            raise ValueError(
                f"checkpoint does not match {arch}: "
                f"missing weights {_preview(missing)}; unexpected weights {_preview(unexpected)}"
            )


def _preview(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return "[" + ", ".join(names[:limit]) + more + "]"
