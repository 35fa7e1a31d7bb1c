"""Load a checked PEFT folder (``peft_config.read_adapter_spec``) into CPU tensors.

``LoRAAdapterWeights.modules`` maps a module path of the base model (``model.layers.0.self_attn.
q_proj``, the checkpoint's names) to ``(A [r, in], B [out, r] * scaling)``: the scaling is folded into
B once here, so the batched ops compute ``y += (x @ A^T) @ B^T``. Cost: the adapter's tensors once, in
float32 (a slot stores them in the model dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.lora.peft_config import AdapterSpec, lora_weight_name


@dataclass
class LoRAAdapterWeights:
    """One adapter's matrices, on the CPU. Invariant: every module has both halves, of rank ``rank``."""

    lora_int_id: int
    rank: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values())


def load_adapter(spec: AdapterSpec, lora_int_id: int) -> LoRAAdapterWeights:
    """Read ``spec.weights_file`` and fold the scaling into B (see the module doc)."""
    if spec.weights_file.endswith(".safetensors"):
        from safetensors.torch import load_file

        tensors = load_file(spec.weights_file, device="cpu")
    else:
        tensors = torch.load(spec.weights_file, map_location="cpu", weights_only=True)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        parsed = lora_weight_name(key)
        if parsed is None:
            raise ValueError(f"lora_request: adapter {spec.path!r} holds {key!r}, which is not a LoRA matrix")
        module, part = parsed
        halves.setdefault(module, {})[part] = tensor.float()
    modules = {}
    for module, parts in halves.items():
        if set(parts) != {"A", "B"} or parts["A"].shape[0] != spec.rank or parts["B"].shape[1] != spec.rank:
            raise ValueError(f"lora_request: adapter {spec.path!r}: {module} lacks a half or is not of rank {spec.rank}")
        modules[module] = (parts["A"].contiguous(), (parts["B"] * spec.scaling).contiguous())
    return LoRAAdapterWeights(lora_int_id, spec.rank, modules)
