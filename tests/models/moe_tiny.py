"""Tiny random mixture-of-experts checkpoints (transformers' own config classes, saved as HF folders).

``make_tiny_moe(arch, folder)`` writes config.json + model.safetensors (no tokenizer: tests pass token
ids with ``skip_tokenizer_init``). Each arch also exercises one config feature: Mixtral renormalised
top-2 of 6 experts; Qwen3-MoE top-3 of 8 with ``norm_topk_prob`` and a dense layer
(``mlp_only_layers``), q/k norm and head_dim 32 != 64/4; Qwen2-MoE top-2 of 6 without renormalising,
the shared expert and its gate, qkv bias and ``decoder_sparse_step`` 2 (layers 0 and 2 dense).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

MOE_ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe")
VOCAB = 512
_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=2048, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_EXTRAS = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=6, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                         norm_topk_prob=True, mlp_only_layers=[1], head_dim=32)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, decoder_sparse_step=2)),
}
INIT_STD = 0.15  # as tests/helpers.py: greedy outputs vary from token to token


def tiny_moe_config(arch: str, **overrides):
    import transformers

    name, extras = _EXTRAS[arch]
    return getattr(transformers, name)(**{**_COMMON, **extras, **overrides})


def make_tiny_moe(arch: str, folder: str | os.PathLike, seed: int = 0, **overrides) -> str:
    """Write a tiny random ``arch`` checkpoint (float32 safetensors) to ``folder``; returns its path."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            else:
                param.normal_(0.0, INIT_STD)
    model.save_pretrained(folder)
    return str(Path(folder))
