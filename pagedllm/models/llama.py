"""One decoder for Llama (incl. SmolLM2), Mistral, Qwen2 and Qwen3, driven by the HF config.

Differences between the four, all read from the config:
  - Qwen2: bias on q/k/v (not on o_proj).
  - Qwen3: RMSNorm over each head of q and k (``q_norm``/``k_norm``) before RoPE; ``head_dim`` may
    differ from hidden_size / num_heads.
  - Llama: ``attention_bias`` (q/k/v/o) and ``mlp_bias`` flags; llama3 RoPE scaling.
  - Mistral / Qwen sliding window: each layer's window (``loader.architectures.layer_sliding_windows``:
    every Mistral layer, Qwen's layers from ``max_window_layers`` on) goes to its ``Attention``.

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

from pagedllm.distributed import get_pp_group
from pagedllm.layers import (
    Attention,
    LinearAdd,
    LMHead,
    MergedLinear,
    NormLinear,
    NormQKVRope,
    QKVLinear,
    ResidualForm,
    ResidualState,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    SiluAndMulLinear,
    VocabEmbedding,
    default_weight_loader,
    get_rope_parameters,
)
from pagedllm.loader.architectures import layer_sliding_windows

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


class LlamaAttention(nn.Module):
    """(residual add +) input norm -> qkv projection -> (q/k norm +) RoPE -> paged attention -> o_proj.

    ``input_layernorm`` is the decoder layer's (registered there, under its checkpoint name).
    ``rotary_emb`` is the model's one shared table (a submodule of every layer, stored once).
    Cost: the qkv and o projections, one (q/k norm +) RoPE + K/V store launch on CUDA, and the
    attention backend's launches; which of them fuse with the norm or the residual add, and where,
    is the compound modules' business (``layers/compound.py``).
    """

    def __init__(self, cfg: Any, rotary_emb: RotaryEmbedding, input_layernorm: RMSNorm,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(cfg)
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias = attention_bias or cfg.model_type == "qwen2" or bool(getattr(cfg, "qkv_bias", False))  # Qwen2-MoE
        self.qkv_proj = QKVLinear(cfg.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, qkv_bias)
        self.o_proj = RowParallelLinear(self.num_heads * self.head_dim, cfg.hidden_size, bias=attention_bias)
        # This rank's heads (all of them at one tensor-parallel rank).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_norm = self.k_norm = None
        if cfg.model_type in ("qwen3", "qwen3_moe"):
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, sliding_window)
        self.norm_qkv_rope = NormQKVRope(input_layernorm, self.qkv_proj, rotary_emb, self.attn,
                                         self.q_norm, self.k_norm)
        self.output = LinearAdd(self.o_proj)

    def forward(self, positions: torch.Tensor, state: ResidualState) -> ResidualState:
        q, k, v, kv_stored = self.norm_qkv_rope(positions, state)
        return self.output(self.attn(q, k, v, kv_stored=kv_stored), state)


class LlamaMLP(nn.Module):
    """(residual add +) post-attention norm -> ``down(silu(gate) * up)``; ``post_attention_layernorm``
    is the decoder layer's. Cost: the gate_up and down projections and one activation launch on
    CUDA (fused with them where ``layers/compound.py`` says)."""

    def __init__(self, cfg: Any, post_attention_layernorm: RMSNorm) -> None:
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        bias = bool(getattr(cfg, "mlp_bias", False))
        size = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [size, size], bias=bias)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, bias=bias)
        self.act = SiluAndMul()
        self.norm_gate_up = NormLinear(post_attention_layernorm, self.gate_up_proj)
        self.act_down = SiluAndMulLinear(self.act, self.down_proj)

    def forward(self, state: ResidualState) -> ResidualState:
        return self.act_down(self.norm_gate_up(state), state)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))`` on the residual state."""

    def __init__(self, cfg: Any, rotary_emb: RotaryEmbedding, sliding_window: int | None = None) -> None:
        super().__init__()
        input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary_emb, input_layernorm, sliding_window)
        self.mlp = LlamaMLP(cfg, post_attention_layernorm)
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def forward(self, positions: torch.Tensor, state: ResidualState) -> ResidualState:
        return self.mlp(self.self_attn(positions, state))


class OtherStageLayer(nn.Module):
    """The place of a decoder layer that lives on another pipeline stage: no parameters, never
    called (it keeps the stage's layers at their checkpoint indices, ``model.layers.N``)."""


class LlamaModel(nn.Module):
    """Embedding -> decoder layers -> final norm. The residual stream travels as a ``ResidualState``
    whose form ``self.residual`` chooses per forward (``layers/residual.py``).

    Pipeline parallel (``distributed.get_pp_group()``): this stage runs ``layer_range``; a stage
    after the first starts from ``intermediate``, the residual stream ``[T, hidden]`` the previous
    stage returned, instead of the embedding, and a stage before the last returns its residual
    stream instead of the final hidden states (the runner sends and receives it:
    ``worker/pipeline_stage.py``; a model never communicates). Every stage holds the embedding,
    the final norm and the LM head (so a tied head has its table): one vocabulary table of memory
    per stage, for one code path."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.pp = get_pp_group()
        self.layer_range = self.pp.layer_range(cfg.num_hidden_layers)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        head_dim = head_dim_of(cfg)
        rotary_dim = int(head_dim * get_rope_parameters(cfg).get("partial_rotary_factor", 1.0))
        self.rotary_emb = RotaryEmbedding(cfg, head_dim, cfg.max_position_embeddings, rotary_dim)  # shared
        self.sliding_windows = layer_sliding_windows(cfg)  # each layer's window (None: full attention)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) if i in self.layer_range
                                    else OtherStageLayer() for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual = ResidualForm()

    def make_layer(self, cfg: Any, index: int) -> nn.Module:
        """Decoder layer ``index`` (a subclass may vary the layer by index, e.g. MoE or dense MLP)."""
        return LlamaDecoderLayer(cfg, self.rotary_emb, self.sliding_windows[index])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: torch.Tensor | None = None) -> torch.Tensor:
        if self.pp.is_first:
            state = self.residual(self.embed_tokens(input_ids))
        else:
            state = self.residual(intermediate)
        for i in self.layer_range:
            state = self.layers[i](positions, state)
        if not self.pp.is_last:
            return _residual_stream(state)
        return state.normed(self.norm)


def _residual_stream(state: ResidualState) -> torch.Tensor:
    """The running sum of a layer's output and its residual (what the next stage starts from)."""
    if state.is_stream:
        return state.stream
    return state.hidden if state.residual is None else state.hidden + state.residual


class LlamaForCausalLM(nn.Module):
    """The causal LM; provides ``models/interface.CausalLM`` (what the runner may call: forward,
    compute_logits, the attention layers and their KV caches, load_weights, config,
    max_supported_len: None, no cap beyond the config's positions).

    Subclasses sharing its KV-cache and loading code (``gemma.py``, ``phi3.py``) keep its layout:
    ``self.model`` with ``layers[i].self_attn.attn``, ``layer_range``, ``embed_tokens`` (and
    ``residual`` where it has residual forms); ``self.lm_head``; and may rewrite checkpoint tensors
    in ``checkpoint_weights``."""

    # Our merged layers -> the checkpoint modules each stands for (a quantization config's ignore
    # list names the latter; vLLM's attribute name). The same facts as ``STACKED_PARAMS``.
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    model_class: type[LlamaModel] = LlamaModel  # the decoder stack (a subclass may swap its layers)

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.config = hf_config
        self.model = self.model_class(hf_config)
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = LMHead(hf_config.vocab_size, hf_config.hidden_size, self.model.embed_tokens if tied else None)
        self.max_supported_len: int | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, hidden]`` final hidden states; on a pipeline stage before the last, the residual
        stream the next stage takes as ``intermediate`` (which a stage after the first needs)."""
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """``[N, vocab]`` logits, float32 (or in the model dtype with ``upcast=False``)."""
        return self.lm_head(hidden, upcast)

    # ---- KV cache -------------------------------------------------------------------------------
    @property
    def attention_layers(self) -> list[Attention]:
        """This pipeline stage's attention layers (all of them at one stage), in layer order."""
        return [self.model.layers[i].self_attn.attn for i in self.model.layer_range]

    @property
    def num_attention_layers(self) -> int:
        return len(self.model.layer_range)

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
    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's ``(name, tensor)`` pairs as ``load_weights`` maps them (HF names, unfused
        q/k/v and gate/up); a family whose checkpoint differs rewrites them here."""
        return weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into our parameters; raise ValueError naming every missing
        or unexpected weight. A tied model ignores a checkpoint's ``lm_head.weight`` (HF saves it
        sometimes); ``rotary_emb.inv_freq`` entries are ignored."""
        residual_form = getattr(self.model, "residual", None)  # Gemma's model has no residual forms
        if residual_form is not None:
            residual_form.use_stream_from(None)  # the checkpoint's norm weights come back
        params = dict(self.named_parameters())  # a tied lm_head appears once, as model.embed_tokens.weight
        loaded: set[tuple[str, object]] = set()
        unexpected: list[str] = []
        for name, tensor in self.checkpoint_weights(weights):
            if name.endswith(IGNORED_SUFFIXES) or (self.lm_head.tied and name == "lm_head.weight"):
                continue
            if name.startswith("model.layers.") and int(name.split(".")[2]) not in self.model.layer_range:
                continue  # another pipeline stage's layer
            target, shard_id = self.checkpoint_target(name)
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


    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """``(our parameter name, shard id)`` for checkpoint weight ``name`` (``STACKED_PARAMS``)."""
        for ckpt_part, our_part, shard in STACKED_PARAMS:
            if ckpt_part in name:
                return name.replace(ckpt_part, our_part), shard
        return name, None


def _preview(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return "[" + ", ".join(names[:limit]) + more + "]"
