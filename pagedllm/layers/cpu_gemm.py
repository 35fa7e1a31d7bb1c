"""Linear layers on the CPU through oneDNN, with each weight reordered ("prepacked") once.

``F.linear`` on the CPU calls MKL's sgemm, which re-packs the weight matrix into its blocked layout
on every call: at decode sizes (a few to a few hundred rows) that repacking is a second full pass
over the weights. oneDNN can keep the weight in its blocked layout (an ``mkldnn`` tensor made once
by ``_reorder_linear_weight``), so each call streams the weights once. Measured on the 2-core
AVX-512 CI machine over all 121 linear layers of SmolLM2-135M in float32 (``benchmarks/cpu_linear.py``):

    rows                 1       8      32      64     128     512
    F.linear (ms)     46.7    60.0    94.1   142.9   240.2   812.2
    prepacked (ms)    26.3    25.9    53.5    91.9   170.1   675.4

Results equal ``F.linear``'s up to float32 summation order (a few ulps), so greedy outputs stay
exact against transformers except at near-ties, as with any GEMM.

Cost: one extra copy of each packed weight in host memory (the original parameter is kept: the
loaders, tied embeddings and tests read it). Packing happens once, after the weights are loaded
(``pack_linear_weights``); a layer never packed, or on another device, uses ``F.linear``. The
ops are PyTorch internals (used by inductor's CPU freezing pass); where a build lacks them
``available()`` is False and nothing changes.
"""

from __future__ import annotations

import torch
from torch import nn

PACKABLE_DTYPES = (torch.float32,)


def available() -> bool:
    """Whether this torch build has oneDNN and the prepacked-linear ops."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-blocked copy of a ``[N, K]`` CPU weight, or None where the fast path does not apply."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES or weight.dim() != 2 or not available():
        return None
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 64)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` with ``packed = pack_weight(W)``; ``x`` is ``[..., K]`` on the CPU."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def pack_linear_weights(model: nn.Module) -> int:
    """Pack every layer that supports it (``pack_cpu_weight()``); returns how many were packed."""
    count = 0
    for module in model.modules():
        pack = getattr(module, "pack_cpu_weight", None)
        if pack is not None and pack():
            count += 1
    return count
