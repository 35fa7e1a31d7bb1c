"""The ops of encoder models (BERT family): LayerNorm, GELU and bidirectional attention.

``EncoderAttention`` is the encoder's attention: every token of a prompt attends to every token of
the same prompt (no causal mask), and nothing is stored in a KV cache. That is exact only when a
step holds each prompt whole, which the engine guarantees for an encoder (``runner="pooling"``
turns chunked prefill and prefix caching off for it: ``engine/config_builder.py``). The ragged
batch comes from the forward context's metadata (``query_start_loc``), as for the paged layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backend import get_forward_context
from pagedllm.layers.custom_op import CustomOp

GELU_APPROXIMATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


class LayerNorm(CustomOp):
    """``F.layer_norm`` over the last dim with a weight and a bias (post-LN encoders)."""

    fuses_kernels = True

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class GELU(CustomOp):
    """GELU by the name of the config's ``hidden_act`` ("gelu": erf; "gelu_new" and
    "gelu_pytorch_tanh": the tanh approximation); ValueError naming ``hidden_act`` otherwise."""

    fuses_kernels = True

    def __init__(self, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in GELU_APPROXIMATIONS:
            raise ValueError(f"hidden_act {hidden_act!r} is not supported for encoders "
                             f"(one of {sorted(GELU_APPROXIMATIONS)})")
        self.approximate = GELU_APPROXIMATIONS[hidden_act]

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.approximate)


class EncoderAttention(CustomOp):
    """``forward(q, k, v [T, H*D]) -> [T, H*D]``: each prompt of the step attends to itself, in
    full (module doc). ``native``: one ``scaled_dot_product_attention`` per prompt; ``cuda``: one
    varlen flash-attention call over the whole ragged batch (``torch.nn.attention.varlen``) in
    half precision, else the native loop. Cost: O(sum of prompt_len^2 * H * D) either way."""

    fuses_kernels = True

    def __init__(self, num_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], self.num_heads, self.head_dim)

    def forward_native(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context().attn_metadata
        starts = meta.query_start_loc.tolist()
        if meta.seq_lens.tolist() != [b - a for a, b in zip(starts, starts[1:])]:
            raise ValueError("EncoderAttention needs whole prompts in a step (no chunked prefill, no prefix hit)")
        # Heads first, once ([H, T, D]); each prompt is then a [1, H, L, D] slice, the form torch's CPU
        # kernel takes fast (a 3-D or strided input is many times slower).
        q, k, v = (self._heads(x).transpose(0, 1).contiguous() for x in (q, k, v))
        out = torch.empty_like(q)
        for a, b in zip(starts, starts[1:]):
            out[:, a:b] = F.scaled_dot_product_attention(q[None, :, a:b], k[None, :, a:b], v[None, :, a:b],
                                                         scale=self.scale)[0]
        return out.transpose(0, 1).reshape(out.shape[1], self.num_heads * self.head_dim)

    def forward_cuda(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.dtype not in (torch.float16, torch.bfloat16):
            return self.forward_native(q, k, v)
        from torch.nn.attention.varlen import varlen_attn

        meta = get_forward_context().attn_metadata
        num_reqs = meta.num_reqs
        cu_seqlens = meta.query_start_loc[: num_reqs + 1]
        num_tokens = meta.num_actual_tokens
        out = varlen_attn(self._heads(q[:num_tokens]), self._heads(k[:num_tokens]), self._heads(v[:num_tokens]),
                          cu_seqlens, cu_seqlens, meta.max_query_len, meta.max_query_len, scale=self.scale)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
