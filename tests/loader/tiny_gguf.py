"""``write_tiny_gguf(path, qtype)``: a tiny random Llama as a llama.cpp GGUF file, written with the
``gguf`` package's writer: the sizes of ``tests/helpers.tiny_config("llama")`` (64 hidden, 128
intermediate, 4 heads, 2 KV heads: everything divides by two ranks and by 32-weight blocks), Q and
K rows permuted as llama.cpp stores them, an untied output matrix (unless ``tied``), the matrices
in ``qtype`` and the norms in F32. No tokenizer metadata (parsing SmolLM2's 49152 tokens costs
seconds per read): an engine takes ``tokenizer=`` a folder saved from
``tests.helpers.default_tokenizer()``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.helpers import tiny_config

HIDDEN_NAMES = {  # HF -> GGUF name of a decoder layer's matrices
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def permute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``permute`` (the inverse of ``gguf_file.unpermute_qk``)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_llama_config(intermediate_size: int | None = None):
    cfg = tiny_config("llama")
    cfg.intermediate_size = intermediate_size or cfg.intermediate_size
    return cfg


def tiny_llama_tensors(seed: int = 0, intermediate_size: int | None = None) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array of a tiny random Llama (HF layout, Q/K permuted)."""
    cfg = tiny_llama_config(intermediate_size)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, mean=0.0, std=0.05):
        return (torch.randn(*shape, generator=gen) * std + mean).numpy()

    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size // cfg.num_attention_heads
    tensors = {"token_embd.weight": rand(cfg.vocab_size, h), "output.weight": rand(cfg.vocab_size, h),
               "output_norm.weight": rand(h, mean=1.0, std=0.1)}
    shapes = {"attn_q": (h, h), "attn_k": (cfg.num_key_value_heads * d, h), "attn_v": (cfg.num_key_value_heads * d, h),
              "attn_output": (h, h), "ffn_gate": (i, h), "ffn_up": (i, h), "ffn_down": (h, i)}
    for layer in range(cfg.num_hidden_layers):
        for name, shape in shapes.items():
            tensors[f"blk.{layer}.{name}.weight"] = rand(*shape)
        tensors[f"blk.{layer}.attn_q.weight"] = permute_qk(tensors[f"blk.{layer}.attn_q.weight"],
                                                           cfg.num_attention_heads)
        tensors[f"blk.{layer}.attn_k.weight"] = permute_qk(tensors[f"blk.{layer}.attn_k.weight"],
                                                           cfg.num_key_value_heads)
        for name in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{layer}.{name}.weight"] = rand(h, mean=1.0, std=0.1)
    return tensors


def write_tiny_gguf(path: str | Path, qtype_name: str, seed: int = 0, intermediate_size: int | None = None,
                    tied: bool = False) -> str:
    """Write the tiny Llama to ``path`` with its matrices in ``qtype_name`` (e.g. "Q8_0", "Q4_1");
    ``intermediate_size`` replaces the tiny config's 128; ``tied``: no output matrix (the LM head is
    the token embedding, as in SmolLM2's file)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    cfg = tiny_llama_config(intermediate_size)
    qtype = GGMLQuantizationType[qtype_name]
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_theta if hasattr(cfg, "rope_theta") else 10000.0))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    for name, array in tiny_llama_tensors(seed, intermediate_size).items():
        if tied and name == "output.weight":
            continue
        if array.ndim == 2:
            writer.add_tensor(name, quantize(np.ascontiguousarray(array, dtype=np.float32), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
