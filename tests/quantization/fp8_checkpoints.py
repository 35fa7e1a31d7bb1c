"""Tiny FP8 checkpoints written by the tests, and the float reference they stand for.

``write_fp8_checkpoint`` turns a tiny float checkpoint (``tests.helpers.make_tiny_model``) into an
FP8 one in the layout of vLLM's ``fp8`` or llm-compressor's ``compressed-tensors`` format: each
projection's weight float8_e4m3fn with its ``weight_scale`` (per tensor, a 0-d tensor; per channel,
``[N, 1]``) and, for static activations, an ``input_scale``. ``reference_model`` is the float model
that checkpoint stands for: the dequantized weights, and each linear quantizing its input the way
the scheme says (per token, per tensor, static, or not at all) before a float32 ``F.linear``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pagedllm.layers import Linear
from pagedllm.models import build_model
from pagedllm.quantization import fp8_ops

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STATIC_INPUT_SCALE = 0.02


def fp8_config(activation_scheme: str = "dynamic") -> dict:
    return {"quant_method": "fp8", "activation_scheme": activation_scheme}


def compressed_tensors_config(weights: str = "channel", activations: dict | None = None,
                              ignore: list[str] | None = None) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ignore or ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"type": "float", "num_bits": 8, "strategy": weights, "symmetric": True, "dynamic": False},
                "input_activations": activations}}}


def _is_projection(name: str, skip: tuple[str, ...]) -> bool:
    return name.endswith(".weight") and any(f".{p}." in name for p in PROJECTIONS) and not any(s in name for s in skip)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Wq, scale_inv [ceil(N / bn), ceil(K / bk)])``: one scale per block, its largest magnitude at 448."""
    bn, bk = block
    n, k = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -k % bk, 0, -n % bn))
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / fp8_ops.FP8_MAX).clamp_min(fp8_ops.MIN_SCALE)
    wq = (w / fp8_ops.expand_blocks(scale, bn, bk, n, k)).clamp(-448, 448).to(fp8_ops.FP8_DTYPE)
    return wq, scale


def write_fp8_checkpoint(src: str, dst: Path, quantization_config: dict, per_channel: bool,
                         static_input: bool = False, skip: tuple[str, ...] = ()) -> str:
    """Copy ``src`` to ``dst`` with its projections (but those whose name contains one of ``skip``)
    stored in FP8, and ``quantization_config`` in config.json (block-wise where it has
    ``weight_block_size``)."""
    block = quantization_config.get("weight_block_size")
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if not _is_projection(name, skip):
            out[name] = t
            continue
        if block:
            wq, scale_inv = quantize_blocks(t, tuple(block))
            out[name], out[name.replace(".weight", ".weight_scale_inv")] = wq, scale_inv
            continue
        if per_channel:
            wq, scale = fp8_ops.quantize_rows(t)
            scale = scale[:, None]
        else:
            scale = (t.abs().max() / fp8_ops.FP8_MAX).float()
            wq = (t / scale).clamp(-448, 448).to(fp8_ops.FP8_DTYPE)
        out[name], out[name.replace(".weight", ".weight_scale")] = wq, scale
        if static_input:
            out[name.replace(".weight", ".input_scale")] = torch.tensor(STATIC_INPUT_SCALE)
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def dequantized_weights(folder: str, block: tuple[int, int] | None = None) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every FP8 weight dequantized (scales dropped)."""
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    out = []
    for name, t in tensors.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if t.dtype == fp8_ops.FP8_DTYPE and block:
            scale = tensors[name.replace(".weight", ".weight_scale_inv")]
            t = t.float() * fp8_ops.expand_blocks(scale, *block, *t.shape)
        elif t.dtype == fp8_ops.FP8_DTYPE:
            t = t.float() * tensors[name.replace(".weight", ".weight_scale")].float().reshape(-1, 1)
        out.append((name, t))
    return out


def reference_model(hf_config, folder: str, activations: str | None, skip: tuple[str, ...] = (),
                    block: tuple[int, int] | None = None) -> torch.nn.Module:
    """The float32 model the FP8 checkpoint stands for (module doc); layers named with one of
    ``skip`` stay plain float layers; ``block``: block-wise weights, activations per token and group."""
    model = build_model(hf_config, torch.float32, "cpu")
    model.load_weights(dequantized_weights(folder, block))
    if block:
        for module in model.modules():
            if isinstance(module, Linear):
                def grouped(x, m=module):
                    xq, scale = fp8_ops.quantize_activation_groups(x, block[1])
                    return F.linear(xq.float() * fp8_ops.expand_blocks(scale, 1, block[1], *x.shape), m.weight, m.bias)
                module.forward = grouped
        return model
    for name, module in model.named_modules():
        if isinstance(module, Linear) and activations is not None and not any(s in name for s in skip):
            static = torch.tensor(STATIC_INPUT_SCALE) if activations == "static" else None

            def forward(x, m=module, static=static):
                xq, scale = fp8_ops.quantize_activations(x, static, per_token=activations == "token")
                return F.linear(xq.float() * scale, m.weight, m.bias)

            module.forward = forward
    return model
