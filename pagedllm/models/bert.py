"""BERT-family encoders (``BertModel``; ``BertForMaskedLM`` folders too) as embedding models.

What sentence-transformers' models (all-MiniLM, BGE) compute before pooling: word + absolute
position + token-type embeddings (token type 0 everywhere: one sentence), LayerNorm, then post-LN
blocks ``h = LN(h + attn(h)); h = LN(h + W2 gelu(W1 h))`` with bidirectional attention over the
prompt (``layers/encoder.EncoderAttention``: no KV cache, each prompt whole in its step).
Tokens are flattened as in every model here: ``forward(input_ids [T], positions [T]) -> [T, hidden]``.

Checkpoint names are HF's (``encoder.layer.N.attention.self.query...``); q/k/v load into one merged
projection, a ``bert.`` prefix (masked-LM folders) is dropped, and the heads pagedllm does not run
(``pooler.*``, ``cls.*``) are skipped. One rank only (no tensor or pipeline parallelism).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.distributed import get_pp_group
from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.layers import Linear, QKVLinear, VocabEmbedding, default_weight_loader
from pagedllm.layers.encoder import GELU, EncoderAttention, LayerNorm

# checkpoint fragment -> (our fragment, shard of the merged q/k/v projection)
_QKV = {".attention.self.query.": "q", ".attention.self.key.": "k", ".attention.self.value.": "v"}
_SKIPPED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids")


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.word_embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = VocabEmbedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = VocabEmbedding(getattr(cfg, "type_vocab_size", 2), cfg.hidden_size)
        self.LayerNorm = LayerNorm(cfg.hidden_size, getattr(cfg, "layer_norm_eps", 1e-12))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        token_types = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_types)
        return self.LayerNorm(x + self.position_embeddings(positions))


class BertSelfOutput(nn.Module):
    """``LN(x + dense(h))``: the projection after attention or the MLP, and the post-LN."""

    def __init__(self, in_features: int, cfg: Any) -> None:
        super().__init__()
        self.dense = Linear(in_features, cfg.hidden_size, bias=True)
        self.LayerNorm = LayerNorm(cfg.hidden_size, getattr(cfg, "layer_norm_eps", 1e-12))

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(x + self.dense(h))


class BertAttention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        num_heads = cfg.num_attention_heads
        head_dim = cfg.hidden_size // num_heads
        self.qkv_proj = QKVLinear(cfg.hidden_size, head_dim, num_heads, num_heads, bias=True)
        self.attn = EncoderAttention(num_heads, head_dim, head_dim**-0.5)
        self.output = BertSelfOutput(cfg.hidden_size, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        return self.output(self.attn(q, k, v), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.act = GELU(getattr(cfg, "hidden_act", "gelu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg.intermediate_size, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))


class BertModel(nn.Module):
    """The encoder; provides ``models/interface.py``'s pooling-model members. It has no paged
    attention layer (``attention_layers`` is empty): the engine's KV blocks are bookkeeping only."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        position_type = getattr(hf_config, "position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"position_embedding_type {position_type!r} is not supported (only 'absolute')")
        if get_tp_group().size > 1 or get_pp_group().size > 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be 1 for encoder models")
        self.config = hf_config
        self.max_supported_len: int | None = None
        self.embeddings = BertEmbeddings(hf_config)
        self.encoder = BertEncoder(hf_config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            x = layer(x)
        return x

    # ---- KV cache: none (see the class doc) -------------------------------------------------------
    @property
    def attention_layers(self) -> list:
        return []

    @property
    def num_attention_layers(self) -> int:
        return 0

    def kv_cache_shape_per_layer(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        cfg = self.config
        return (2, num_blocks, block_size, cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads)

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        if kv_caches:
            raise ValueError(f"bind_kv_caches: an encoder has no attention cache, got {len(kv_caches)} caches")

    # ---- weights ----------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names, module doc) into our parameters; ValueError naming every
        missing or unexpected weight."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, object]] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            target, shard_id = _our_name(name)
            if target is None:
                continue
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            try:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"checkpoint weight {name!r}: {e}") from e
            shards = getattr(param, "shard_ids", (None,)) if shard_id is None else (shard_id,)
            loaded.update((target, s) for s in shards)
        expected = {(n, s) for n, p in params.items() for s in getattr(p, "shard_ids", (None,))}
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match BertModel: missing weights {missing[:8] or 'none'}; "
                             f"unexpected weights {unexpected[:8] or 'none'}")


def _our_name(name: str) -> tuple[str | None, str | None]:
    """(our parameter name, q/k/v shard) of a checkpoint name; (None, None) for a skipped one."""
    name = name.removeprefix("bert.")
    if name.startswith(_SKIPPED_PREFIXES):
        return None, None
    if name.endswith(".gamma"):  # checkpoints of the TensorFlow era
        name = name.removesuffix(".gamma") + ".weight"
    elif name.endswith(".beta"):
        name = name.removesuffix(".beta") + ".bias"
    for fragment, shard in _QKV.items():
        if fragment in name:
            return name.replace(fragment, ".attention.qkv_proj."), shard
    return name, None
