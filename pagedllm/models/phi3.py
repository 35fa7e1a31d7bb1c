"""Phi-3 (``Phi3ForCausalLM``): the Llama decoder with the checkpoint's projections fused.

What differs from ``llama.py``, all handled here or by the shared layers:
  - the checkpoint stores ``self_attn.qkv_proj`` ([q; k; v] rows) and ``mlp.gate_up_proj`` ([gate;
    up] rows) as single matrices: they are split at load into the shards our merged layers take
    (so each tensor-parallel rank still loads only its heads' rows);
  - ``rope_scaling`` "longrope" (Phi-3-mini-128k; ``layers/rotary.py`` fixes the long or short
    factors at load, as vLLM does), partial rotary factors;
  - ``sliding_window`` (Phi-3-mini-4k: 2047) slides on every layer, as in transformers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedllm.models.llama import LlamaForCausalLM, head_dim_of


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama with Phi-3's fused checkpoint projections (module doc)."""

    # The checkpoint's modules are already the merged ones: no translation of their names.
    packed_modules_mapping: dict[str, list[str]] = {}

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Split ``qkv_proj`` into ``q_proj`` / ``k_proj`` / ``v_proj`` and ``gate_up_proj`` into
        ``gate_proj`` / ``up_proj`` (HF names); other tensors pass unchanged. Cost: views, no copies."""
        cfg = self.config
        head_dim = head_dim_of(cfg)
        q_size = cfg.num_attention_heads * head_dim
        kv_size = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim
        for name, tensor in weights:
            if ".qkv_proj." in name:
                if tensor.shape[0] != q_size + 2 * kv_size:
                    raise ValueError(f"checkpoint weight {name!r}: {tensor.shape[0]} rows, expected "
                                     f"{q_size} + 2 x {kv_size} (q, k, v)")
                q, k, v = tensor.split([q_size, kv_size, kv_size], dim=0)
                for part, shard in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    yield name.replace(".qkv_proj.", f".{part}."), shard
            elif ".gate_up_proj." in name:
                if tensor.shape[0] != 2 * cfg.intermediate_size:
                    raise ValueError(f"checkpoint weight {name!r}: {tensor.shape[0]} rows, expected "
                                     f"2 x {cfg.intermediate_size} (gate, up)")
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            else:
                yield name, tensor
