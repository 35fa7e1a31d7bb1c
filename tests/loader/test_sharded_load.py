"""Under tensor parallelism each rank reads only its slices of a safetensors checkpoint, and the
model it loads equals the one loaded from whole tensors."""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import make_tiny_model  # noqa: E402

from pagedllm.distributed import TensorParallelGroup, set_tp_group  # noqa: E402
from pagedllm.loader import resolve_model  # noqa: E402
from pagedllm.loader.hf import load_hf_config  # noqa: E402
from pagedllm.loader.weights import SafetensorsSlice, iter_safetensors_weights  # noqa: E402
from pagedllm.models.registry import build_model  # noqa: E402


def test_a_slice_reads_only_its_rows_or_columns(tmp_path):
    w = torch.arange(24, dtype=torch.float32).view(4, 6)
    save_file({"w": w, "b": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    tensors = dict(iter_safetensors_weights(tmp_path, lazy=True))
    assert isinstance(tensors["w"], SafetensorsSlice) and tensors["w"].shape == (4, 6)
    for name, t in iter_safetensors_weights(tmp_path, lazy=True):  # used while the file is open
        if name == "w":
            assert torch.equal(t.narrow(0, 2, 2), w[2:4]) and torch.equal(t.narrow(1, 3, 3), w[:, 3:])
            assert torch.equal(torch.zeros(4, 6).copy_(t), w)  # any other use reads it whole
        else:
            assert torch.equal(t.narrow(0, 1, 2), torch.ones(2)) and t.float().sum() == 3


class LocalRank(TensorParallelGroup):
    def all_reduce(self, x):
        return x

    def all_gather(self, x, dim=-1):
        return x


def test_rank_loads_the_same_shards_from_slices_as_from_whole_tensors(tmp_path):
    folder = make_tiny_model("qwen2", tmp_path / "qwen2")  # biases on q/k/v, an untied head
    source = resolve_model(folder)
    cfg = load_hf_config(source)
    previous = set_tp_group(LocalRank(1, 2))
    try:
        models = []
        for lazy in (True, False):
            model = build_model(cfg, torch.float32, "cpu")
            model.load_weights(iter_safetensors_weights(folder, lazy=lazy))
            models.append(model.state_dict())
    finally:
        set_tp_group(previous)
    assert models[0].keys() == models[1].keys()
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
