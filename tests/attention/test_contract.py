"""The attention-backend contract: registry, builders, KV-cache spec, KV writer, warm-up shapes."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm.attention import registry
from pagedllm.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    KVCacheSpec,
    common_inputs_from_lists,
)
from pagedllm.attention.cpu_backend import CpuBackend
from pagedllm.attention.torch_ref import HostPlannedMetadata, TorchRefBackend
from pagedllm.attention.triton_backend import TritonBackend, TritonMetadata
from pagedllm.sample.bitmask import apply_token_bitmask

PACKAGE = Path(__file__).resolve().parents[2] / "pagedllm"


def test_registry_names_every_backend_and_rejects_others():
    assert registry.get_attention_backend("auto", torch.device("cpu")).name == "cpu"
    assert isinstance(registry.get_attention_backend("torch_ref", "cpu"), TorchRefBackend)
    with pytest.raises(ValueError, match="'cpu', 'torch_ref', 'triton'"):
        registry.get_attention_backend("flash", torch.device("cpu"))


def test_a_registered_backend_is_selectable(monkeypatch):
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))

    class Mine(TorchRefBackend):
        name = "mine"

    registry.register_attention_backend(Mine)
    assert isinstance(registry.get_attention_backend("mine", torch.device("cpu")), Mine)


def test_each_builder_makes_its_backends_metadata_from_the_common_inputs():
    common = common_inputs_from_lists([3, 1], [5, 9], [[4, 2], [7, 1, 3]], [17, 18, 19, 13], "cpu")
    assert common.block_tables.tolist() == [[4, 2, 0], [7, 1, 3]] and common.num_actual_tokens == 4
    ref = TorchRefBackend.metadata_builder.build(common)
    assert isinstance(ref, HostPlannedMetadata) and ref.query_start_loc_cpu == [0, 3, 4] and ref.seq_lens_cpu == [5, 9]
    assert type(CpuBackend.metadata_builder.build(common)) is HostPlannedMetadata
    common.longest_first = torch.tensor([1, 0], dtype=torch.int32)
    tri = TritonBackend.metadata_builder.build(common)
    assert isinstance(tri, TritonMetadata) and tri.decode_order is common.longest_first
    assert not hasattr(tri, "query_start_loc_cpu") and not hasattr(ref, "decode_order")


def test_kv_cache_spec_and_writer():
    spec = TorchRefBackend().kv_cache_spec(2, 16, torch.bfloat16, 8)
    assert spec == KVCacheSpec(8, 2, 16, torch.bfloat16) and spec.shape(5) == (2, 5, 8, 2, 16)
    assert spec.bytes_per_block == 2 * 8 * 2 * 16 * 2
    assert TritonBackend.kv_writer is not None and TritonBackend.kv_writer.layout == spec.layout
    assert not CpuBackend().accepts_stored_kv and not TorchRefBackend().accepts_stored_kv
    assert TritonBackend.supports_decode_graphs and not AttentionBackend.supports_decode_graphs


def test_no_metadata_is_built_by_hand_in_the_package():
    """Only builders construct metadata (DESIGN rule 10): every ``*Metadata(`` call in the package
    is a class statement or sits in a ``build`` method."""
    names = "|".join(c.__name__ for c in (AttentionMetadata, HostPlannedMetadata, TritonMetadata))
    calls = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for m in re.finditer(rf"^(.*)\b({names})\(", text, flags=re.MULTILINE):
            enclosing = re.findall(r"def (\w+)\(", text[: m.start()])
            if not m.group(1).lstrip().startswith("class ") and (not enclosing or enclosing[-1] != "build"):
                calls.append(f"{path.relative_to(PACKAGE)}: {m.group(0).strip()}")
    assert calls == []


def test_bitmask_keeps_only_the_allowed_tokens():
    logits = torch.zeros(3, 70)
    mask = np.zeros((2, 3), dtype=np.int32)
    mask[0, 0] = 0b101  # tokens 0 and 2
    mask[1, 2] = 1 << 5  # token 69
    apply_token_bitmask(logits, torch.tensor([0, 2]), mask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[1]).all()
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [69]
