"""Rotary position embedding, NeoX style (rotate the two halves of each head), as HF Llama/Qwen/Mistral.

The inverse frequencies come from transformers' ``ROPE_INIT_FUNCTIONS`` so that the scaled variants
("linear", "llama3", "yarn", "longrope") match HF exactly; "default" is computed here (transformers 5
no longer lists it). "dynamic" rescales with the batch's length in HF, which a paged cache cannot
follow, so it is refused. "longrope" (Phi-3) switches in HF from its short to its long factors once
a sequence passes ``original_max_position_embeddings``, re-rotating the whole cache; a paged cache
keeps its rotated keys, so the factors are fixed at load, as in vLLM: the long ones when the model's
context (``max_position_embeddings``) is longer than the original, else the short ones.
Models with RoPE per layer type (Gemma 3: ``rope_parameters`` keyed by "sliding_attention" /
"full_attention") build one table per type (``layer_type``).

Cost: a float32 cos/sin table ``[max_position, rotary_dim]`` built once on the model's device
(``max_position * rotary_dim * 4`` bytes), shared by all layers. Per layer, CUDA: one fused Triton
launch (``triton_ops.qk_norm_rope``) rotates q and k, reading cos/sin rows by position; CPU in
float32: one C pass per tensor; native: the torch path gathers the rows and rotates with
``apply_rotary`` (the oracle).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.layers import triton_ops
from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.norm import RMSNorm
from pagedllm.native import kernels as native

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def get_rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The config's RoPE settings (of ``layer_type``'s layers, where they are per layer type) as one
    flat dict with at least ``rope_type`` and ``rope_theta``.

    transformers >= 5 keeps them in ``config.rope_parameters``; older versions in ``config.rope_theta``
    plus an optional ``config.rope_scaling`` dict (whose type key may be ``type``).
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def compute_inv_freq(hf_config: Any, rotary_dim: int, device: torch.device | None = None,
                     layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim // 2] float32, attention scaling applied to cos and sin)."""
    params = get_rope_parameters(hf_config, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
        return 1.0 / (params["rope_theta"] ** exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs: dict[str, Any] = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type == "longrope":  # the long factors iff the context is longer than the original (module doc)
        kwargs["seq_len"] = int(hf_config.max_position_embeddings)
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, device, **kwargs)
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(CustomOp):
    """``forward(positions, q, k, q_norm=None, k_norm=None)`` -> rotated (q, k); ``cos_sin(positions)``
    -> (cos, sin) ``[T, rotary_dim // 2]`` for ``apply_rotary``; ``forward_and_store`` (CUDA) also
    writes k and v into the paged KV cache in the same launch.

    The table is computed like HF's forward (``position * inv_freq`` in float32, then cos/sin), so
    in float32 the result is bit-identical; in half precision cos/sin are cast to the input dtype,
    again as HF does. ``forward`` rotates ``q`` ``[T, H, head_dim]`` and ``k`` ``[T, Hkv, head_dim]``
    (strided views are fine) at ``positions`` ``[T]``; with ``q_norm``/``k_norm`` (``RMSNorm`` over
    head_dim, Qwen3) each head is normed first. It returns new tensors; the inputs are not modified.
    """

    fuses_kernels = True

    def __init__(self, hf_config: Any, head_dim: int, max_position: int, rotary_dim: int | None = None,
                 layer_type: str | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.max_position = max_position
        device = torch.empty(0).device  # the construction device (build_model sets it)
        inv_freq, scaling = compute_inv_freq(hf_config, self.rotary_dim, device, layer_type)
        freqs = torch.arange(max_position, device=device).float()[:, None] * inv_freq[None, :]
        self.register_buffer("cos_cache", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_cache[positions], self.sin_cache[positions]

    def forward_native(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = _normed(q, k, q_norm, k_norm)
        cos, sin = self.cos_sin(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def forward_cpu(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = _normed(q, k, q_norm, k_norm)
        if q.dim() == 3 and k.dim() == 3 and native.applies(q, k, self.cos_cache, self.sin_cache):
            # CPU float32: one pass per tensor in C instead of ~8 torch ops.
            return (native.rotary_embedding(q, positions, self.cos_cache, self.sin_cache),
                    native.rotary_embedding(k, positions, self.cos_cache, self.sin_cache))
        return self.forward_native(positions, q, k)

    def forward_cuda(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fusable(q, k, q_norm, k_norm):
            return triton_ops.qk_norm_rope(positions, q, k, self.cos_cache, self.sin_cache,
                                           _norm_args(q_norm), _norm_args(k_norm))
        return self.forward_native(positions, q, k, q_norm, k_norm)

    def forward_and_store(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        q_norm: RMSNorm | None, k_norm: RMSNorm | None,
        kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        row_scale: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor | None:
        """``forward`` with the attention's KV store folded into the same launch (CUDA): the rotated k
        and the value go straight into the cache (``kv_store = Attention.fused_kv_store(v)``); returns
        the rotated q. None when the fused kernel does not apply (another implementation, or inputs it
        does not take: the caller then uses ``forward`` and lets the backend store): one launch per
        layer instead of two. ``row_scale = (s, eps)``: q, k and v are first scaled by each token's
        RMS of ``s`` (``norm.rms_scale``) in the same launch."""
        value, kv_cache = kv_store[0], kv_store[1]
        if not (self.impl == "cuda" and self.fuses_kernels and self._fusable(q, k, q_norm, k_norm)
                and kv_cache.dtype == k.dtype and value.stride(-1) == 1 and triton_ops.row_scale_fits(q, row_scale)):
            return None
        q_rot, _ = triton_ops.qk_norm_rope(positions, q, k, self.cos_cache, self.sin_cache, _norm_args(q_norm),
                                           _norm_args(k_norm), kv_store, row_scale)
        return q_rot

    def _fusable(self, q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> bool:
        """The fused kernel's preconditions: CUDA, one dtype, full rotary, unit last stride, norms both
        or neither with weights in q's dtype."""
        return (
            triton_ops.fusable(q)
            and k.dtype == q.dtype
            and q.dim() == 3
            and k.dim() == 3
            and self.rotary_dim == self.head_dim == q.shape[-1] == k.shape[-1]
            and q.stride(-1) == 1
            and k.stride(-1) == 1
            and self.cos_cache.dtype == torch.float32
            and (q_norm is None) == (k_norm is None)
            and (q_norm is None or (q_norm.weight.dtype == k_norm.weight.dtype == q.dtype
                                    and q_norm.fuses_kernels and k_norm.fuses_kernels))
        )


def _normed(q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm | None,
            k_norm: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` through their per-head norms, where given."""
    return (q_norm(q) if q_norm is not None else q), (k_norm(k) if k_norm is not None else k)


def _norm_args(norm: RMSNorm | None) -> tuple[torch.Tensor, float] | None:
    """A per-head RMSNorm as the fused kernel takes it: ``(weight, eps)``, or None."""
    return (norm.weight, norm.eps) if norm is not None else None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` with cos/sin ``[T, rotary_dim // 2]`` (NeoX halves).

    Per pair ``(x1, x2)``: ``(x1*cos - x2*sin, x2*cos + x1*sin)`` -- the same float ops, in the same order,
    as HF's ``x * cos + rotate_half(x) * sin``. Dims past ``rotary_dim`` pass through unchanged.
    """
    half = cos.shape[-1]
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if 2 * half == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., 2 * half :]), dim=-1)
