"""Tiny GPTQ and AWQ checkpoints written by the tests, packed by hand from the formats' published
layouts (independently of ``pagedllm.quantization.int4``), and the float checkpoint they stand for.

Each projection ``W [N, K]`` is quantized per output row and group of input columns (asymmetric:
``scale = (max - min) / 15``, ``zero = round(-min / scale)``; symmetric: ``zero = 8``), and
``dequantized`` holds ``(q - zero) * scale`` with the float16 scale: the float model the checkpoint
stands for. Act-order (GPTQ ``desc_act``): the input columns are assigned to groups in a random
order, given by ``g_idx``.

Layouts (the words are int32):
- GPTQ: ``qweight [K / 8, N]``, nibble ``j`` (bits ``4j..4j+3``) of ``qweight[i, n]`` is ``q[8i + j, n]``
  (``q`` indexed ``[input, output]``); ``qzeros [G, N / 8]``, nibble ``j`` of word ``c`` is column
  ``8c + j``, storing ``zero - 1`` in the "gptq" (v1) format; ``scales [G, N]`` float16; ``g_idx [K]``.
- AWQ (GEMM): ``qweight [K, N / 8]`` and ``qzeros [G, N / 8]``, nibble ``i`` of word ``c`` is column
  ``8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]``; ``scales [G, N]`` float16.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_NIBBLE_COLUMNS = (0, 2, 4, 6, 1, 3, 5, 7)


def gptq_config(group_size: int = 32, desc_act: bool = False, sym: bool = False) -> dict:
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "lm_head": False, "checkpoint_format": "gptq"}


def awq_config(group_size: int = 32) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def _words(nibbles: list[torch.Tensor]) -> torch.Tensor:
    """Eight equally shaped tensors of values 0..15 -> the int32 words with nibble ``i`` = ``nibbles[i]``."""
    word = torch.zeros_like(nibbles[0], dtype=torch.int64)
    for i, v in enumerate(nibbles):
        word |= v.to(torch.int64) << (4 * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def pack_gptq_rows(q: torch.Tensor) -> torch.Tensor:
    """``[K, N]`` -> ``[K / 8, N]``: nibble ``j`` of row ``i`` is row ``8i + j``."""
    return _words([q[j::8] for j in range(8)])


def pack_cols(q: torch.Tensor, columns=tuple(range(8))) -> torch.Tensor:
    """``[R, N]`` -> ``[R, N / 8]``: nibble ``i`` of word ``c`` is column ``8c + columns[i]``."""
    return _words([q[:, c::8] for c in columns])


def quantize(w: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool):
    """``(q [N, K], zero [N, G], scale [N, G] float16, dequantized [N, K] float32)``."""
    n, _ = w.shape
    zero = torch.empty(n, groups)
    scale = torch.empty(n, groups)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            scale[:, g] = cols.abs().amax(dim=1) / 7.5
            zero[:, g] = 8
        else:
            lo, hi = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            scale[:, g] = (hi - lo) / 15
            zero[:, g] = torch.round(-lo / scale[:, g]).clamp(1, 15)  # v1 GPTQ cannot store a zero point of 0
    scale = scale.clamp_min(1e-4).half()
    s, z = scale.float()[:, g_idx], zero[:, g_idx]
    q = torch.clamp(torch.round(w / s) + z, 0, 15)
    return q.to(torch.int64), zero.to(torch.int64), scale, (q - z) * s


def group_index(k: int, group_size: int, act_order: bool, seed: int) -> torch.Tensor:
    """Each input column's group: ``k // group_size``, or in a random order (act-order)."""
    size = group_size if group_size > 0 else k
    if not act_order:
        return torch.arange(k) // size
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // size
    return g_idx


def _quantized_tensors(name: str, w: torch.Tensor, qcfg: dict, seed: int) -> tuple[dict, torch.Tensor]:
    k = w.shape[1]
    g_idx = group_index(k, qcfg["group_size"], qcfg.get("desc_act", False), seed)
    groups = int(g_idx.max()) + 1
    q, zero, scale, deq = quantize(w.float(), g_idx, groups, qcfg.get("sym", False))
    base = name[: -len(".weight")]
    if qcfg["quant_method"] == "gptq":
        tensors = {".qweight": pack_gptq_rows(q.t()), ".qzeros": pack_cols((zero.t() - 1) & 0xF),
                   ".scales": scale.t().contiguous(), ".g_idx": g_idx.to(torch.int32)}
    else:
        tensors = {".qweight": pack_cols(q.t(), AWQ_NIBBLE_COLUMNS),
                   ".qzeros": pack_cols(zero.t(), AWQ_NIBBLE_COLUMNS), ".scales": scale.t().contiguous()}
    return {base + suffix: t.contiguous() for suffix, t in tensors.items()}, deq


def _input_seed(name: str, shared: bool) -> int:
    """The act-order seed of a projection: one per input (q/k/v share theirs, gate/up theirs; GPTQ
    orders columns by the input's statistics), or one per projection (``shared`` False)."""
    if shared:
        for part in ("k_proj", "v_proj"):
            name = name.replace(part, "q_proj")
        name = name.replace("up_proj", "gate_proj")
    return sum(name.encode())


def write_int4_checkpoint(src: str, dst: Path, qcfg: dict, skip: tuple[str, ...] = (),
                          shared_act_order: bool = True) -> tuple[str, str]:
    """``(quantized folder, float folder)``: ``src`` with its projections (but those whose name
    contains one of ``skip``) in ``qcfg``'s int4 format, and the same model with the dequantized
    weights in float32. ``shared_act_order`` False: each projection gets its own act-order."""
    quant_dir, float_dir = dst / "int4", dst / "dequantized"
    shutil.copytree(src, quant_dir)
    shutil.copytree(src, float_dir)
    tensors = load_file(str(Path(src) / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, t in sorted(tensors.items()):
        is_projection = name.endswith(".weight") and any(f".{p}." in name for p in PROJECTIONS)
        if not is_projection or any(s in name for s in skip):
            quantized[name] = dequantized[name] = t
            continue
        packed, dequantized[name] = _quantized_tensors(name, t, qcfg, _input_seed(name, shared_act_order))
        quantized.update(packed)
    save_file(quantized, str(quant_dir / "model.safetensors"))
    save_file(dequantized, str(float_dir / "model.safetensors"))
    config = json.loads((quant_dir / "config.json").read_text())
    config["quantization_config"] = qcfg
    (quant_dir / "config.json").write_text(json.dumps(config))
    return str(quant_dir), str(float_dir)
