"""The torch-free check of a PEFT folder (``lora.peft_config``): what is read (rank, scaling,
targets) and every refusal, each a ValueError starting with the caller's field."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from pagedllm.lora.peft_config import read_adapter_spec
from tests.helpers import tiny_config

CONFIG = tiny_config("llama")  # hidden 64, 4 heads of 16, 2 kv heads, intermediate 128, 3 layers


def write(folder, config: dict | None = None, tensors: dict | None = None, rank: int = 4) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    base = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps({**base, **(config or {})}))
    prefix = "base_model.model.model.layers.0"
    if tensors is None:
        tensors = {f"{prefix}.self_attn.q_proj.lora_A.weight": torch.zeros(rank, 64),
                   f"{prefix}.self_attn.q_proj.lora_B.weight": torch.zeros(64, rank),
                   f"{prefix}.mlp.down_proj.lora_A.weight": torch.zeros(rank, 128),
                   f"{prefix}.mlp.down_proj.lora_B.weight": torch.zeros(64, rank)}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


def test_a_good_folder_is_read(tmp_path):
    spec = read_adapter_spec(write(tmp_path / "a"), 8, CONFIG)
    assert spec.rank == 4 and spec.scaling == 2.0 and spec.target_modules == ("down_proj", "q_proj")
    rs = read_adapter_spec(write(tmp_path / "b", {"use_rslora": True}), 8, CONFIG)
    assert rs.scaling == pytest.approx(8 / math.sqrt(4))


P = "base_model.model.model.layers"


@pytest.mark.parametrize("config,tensors,message", [
    ({"peft_type": "IA3"}, None, "is a IA3 adapter"),
    ({"use_dora": True}, None, "uses DoRA"),
    ({"bias": "all"}, None, "trains biases"),
    ({"rank_pattern": {"q_proj": 2}}, None, "rank_pattern"),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ({"target_modules": ["q_proj", "lm_head"]}, None, r"targets \['lm_head'\]"),
    ({"r": 0}, None, "no valid rank"),
    (None, {f"{P}.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}, "lacks lora_A or lora_B"),
    (None, {f"{P}.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32),
            f"{P}.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)}, "does not fit the base model's q_proj"),
    (None, {f"{P}.7.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
            f"{P}.7.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)}, "no layer of the base model"),
    (None, {f"{P}.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 64),
            f"{P}.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 2)}, "not of rank 4"),
    (None, {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 10)}, "embedding LoRA"),
])
def test_unsupported_adapters_are_refused(tmp_path, config, tensors, message):
    folder = write(tmp_path / "x", config, tensors)
    with pytest.raises(ValueError, match=f"^lora_path: .*{message}"):
        read_adapter_spec(folder, 8, CONFIG, field="lora_path")


def test_rank_above_max_and_missing_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^lora_request: .*rank 16, above max_lora_rank \(8\)"):
        read_adapter_spec(write(tmp_path / "big", rank=16), 8, CONFIG)
    with pytest.raises(ValueError, match="no such directory"):
        read_adapter_spec(str(tmp_path / "none"), 8, CONFIG)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        read_adapter_spec(str(tmp_path / "empty"), 8, CONFIG)
    folder = write(tmp_path / "noweights")
    (tmp_path / "noweights" / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="has no weights file"):
        read_adapter_spec(folder, 8, CONFIG)
