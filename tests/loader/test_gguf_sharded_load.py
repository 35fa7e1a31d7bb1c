"""Under tensor parallelism a GGUF rank reads only its slices: ``GGUFSlice.narrow`` returns exactly
``narrow(dequantize(whole))`` (packed blocks bit for bit where the slice falls on block bounds),
reads only the bytes of the slice, and a rank's model loaded from slices equals the one loaded
from whole tensors, on the packed and the dequantized-float paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.distributed import PipelineParallelGroup, TensorParallelGroup, set_pp_group, set_tp_group
from pagedllm.loader import gguf_file
from pagedllm.loader.gguf_file import GGUFSlice, GGUFTensor, unpermute_qk

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

# (type, shape): 32-weight blocks, and a K-quant's 256-weight super-blocks.
CASES = [("Q8_0", (16, 128)), ("Q4_1", (16, 128)), ("Q4_K", (8, 1024)), ("F16", (8, 64))]


SCALE_OFFSETS = {"Q8_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2)}  # each block's f16 scales, kept finite


def _random_blocks(qtype_name: str, shape: tuple[int, int]) -> np.ndarray:
    """``[rows, row_bytes]`` random blocks of ``qtype_name`` (random bytes, finite f16 scales: the
    ``gguf`` package cannot quantize to every format)."""
    elems, nbytes = gguf.GGML_QUANT_SIZES[GGMLQuantizationType[qtype_name]]
    rows, cols = shape
    raw = np.random.default_rng(0).integers(0, 256, size=(rows, cols // elems, nbytes), dtype=np.uint8)
    for h in SCALE_OFFSETS.get(qtype_name, range(0, nbytes, 2)):
        raw[..., h + 1] &= 0xBB  # f16 exponent below all-ones: no inf / nan
    return raw.reshape(rows, -1)


def _matrix(qtype_name: str, shape: tuple[int, int], permuted_heads: int | None = None, packed: bool = False):
    """A random matrix in ``qtype_name``: (its GGUFSlice, the whole matrix dequantized in HF row order)."""
    qtype = GGMLQuantizationType[qtype_name]
    raw = _random_blocks(qtype_name, shape)
    whole = torch.from_numpy(np.array(dequantize(raw, qtype))).reshape(shape)
    if permuted_heads:
        whole = unpermute_qk(whole, permuted_heads)
    return GGUFSlice("w", raw, int(qtype), shape, permuted_heads, packed), whole


class CountingBytes:
    """A GGUF matrix's bytes that count how many of them are read."""

    def __init__(self, raw: np.ndarray) -> None:
        self.raw, self.bytes_read = raw, 0

    def __getitem__(self, index):
        part = self.raw[index]
        self.bytes_read += part.nbytes
        return part


@pytest.mark.parametrize(("qtype_name", "shape"), CASES)
def test_row_and_column_slices_equal_narrow_of_the_dequantized_whole(qtype_name, shape):
    block = gguf_file.block_geometry(GGMLQuantizationType[qtype_name])[0]
    rows, cols = shape
    packed, whole = _matrix(qtype_name, shape, packed=True)
    plain, _ = _matrix(qtype_name, shape)
    for start, length in ((0, rows // 2), (rows // 2, rows // 2), (3, 2)):
        part = packed.narrow(0, start, length)
        assert isinstance(part, GGUFTensor) and part.shape == (length, cols)
        assert torch.equal(part.dequantize(), whole[start:start + length])
        assert torch.equal(plain.narrow(0, start, length), whole[start:start + length])
    for start, length in ((0, cols // 2), (cols // 2, cols // 2), (block, block)):
        part = packed.narrow(1, start, length)
        assert torch.equal(part.dequantize(), whole[:, start:start + length])
        assert torch.equal(plain.narrow(1, start, length), whole[:, start:start + length])
        # The same blocks as the whole row's bytes hold (nothing re-quantized).
        assert torch.equal(part.data, packed.materialize().narrow(1, start, length).data)


@pytest.mark.parametrize("qtype_name", ["Q8_0", "Q4_K"])
def test_a_slice_inside_blocks_dequantizes_only_the_blocks_it_overlaps(qtype_name, caplog, monkeypatch):
    monkeypatch.setattr(gguf_file, "_REPORTED_CUTS", set())  # warned once per process
    block = gguf_file.block_geometry(GGMLQuantizationType[qtype_name])[0]
    plain, whole = _matrix(qtype_name, (4, 4 * block))
    packed, _ = _matrix(qtype_name, (4, 4 * block), packed=True)
    start, length = block // 2, 2 * block  # cuts the first and the third block
    packed.raw = counting = CountingBytes(packed.raw)
    assert torch.equal(plain.narrow(1, start, length), whole[:, start:start + length])
    part = packed.narrow(1, start, length)  # packed blocks cannot be cut: that slice as F32 rows
    assert part.qtype == gguf_file.F32 and part.shape == (4, length)
    assert torch.equal(part.dequantize(), whole[:, start:start + length])
    assert counting.bytes_read == 3 * counting.raw.shape[1]  # blocks 0-2 of 4, in each of 4 rows
    assert "dequantized to float32" in caplog.text


def test_q_and_k_rows_are_unpermuted_per_slice():
    heads, head_dim = 4, 16
    for packed in (False, True):
        s, whole = _matrix("Q8_0", (heads * head_dim, 64), permuted_heads=heads, packed=packed)
        for start, length in ((0, 32), (32, 32), (8, 20)):  # two heads each, and rows inside heads
            part = s.narrow(0, start, length)
            values = part.dequantize() if packed else part
            assert torch.equal(values, whole[start:start + length])


@pytest.mark.parametrize("packed", [False, True])
def test_a_slice_reads_only_its_bytes(packed):
    s, whole = _matrix("Q4_1", (64, 256), packed=packed)
    row_bytes = s.raw.shape[1]
    s.raw = counting = CountingBytes(s.raw)
    s.narrow(0, 32, 32)  # column-parallel: half the rows
    assert counting.bytes_read == 32 * row_bytes
    counting.bytes_read = 0
    s.narrow(1, 128, 128)  # row-parallel: half the blocks of every row
    assert counting.bytes_read == 64 * row_bytes // 2


class LocalRank(TensorParallelGroup):
    def all_reduce(self, x):
        return x

    def all_gather(self, x, dim=-1):
        return x


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(path, HF config) of a tiny Q4_1 Llama GGUF (32-weight blocks: every slice is whole blocks)."""
    from pagedllm.loader import load_hf_config, resolve_model
    from tests.loader.tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path_factory.mktemp("tiny_gguf") / "tiny-Q4_1.gguf", "Q4_1")
    return path, load_hf_config(resolve_model(path))


def _load_rank_model(tiny_gguf, lazy: bool | None, packed: bool) -> torch.nn.Module:
    from pagedllm.models.registry import build_model, process_quantized_weights
    from pagedllm.quantization.gguf import GGUFConfig

    path, config = tiny_gguf
    model = build_model(config, torch.float32, "cpu", GGUFConfig() if packed else None)
    weights = gguf_file.iter_gguf_packed_weights(path, lazy) if packed else gguf_file.iter_gguf_weights(path, lazy)
    model.load_weights(weights)
    process_quantized_weights(model)
    return model


def test_matrices_come_unread_under_tensor_parallel_only(tiny_gguf):
    name = "model.layers.0.mlp.down_proj.weight"
    assert isinstance(dict(gguf_file.iter_gguf_packed_weights(tiny_gguf[0]))[name], GGUFTensor)
    previous = set_tp_group(LocalRank(0, 2))
    try:
        assert isinstance(dict(gguf_file.iter_gguf_packed_weights(tiny_gguf[0]))[name], GGUFSlice)
    finally:
        set_tp_group(previous)


@pytest.mark.parametrize("packed", [True, False])
def test_rank_loads_the_same_shards_from_slices_as_from_whole_tensors(tiny_gguf, packed, monkeypatch,
                                                                      tmp_path):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))  # the float path: from the file, no cache
    read = []
    covering = gguf_file._covering_blocks

    def counting(raw, *args):
        part, offset = covering(raw, *args)
        if isinstance(raw, np.ndarray):  # a read from the memory-mapped file
            read.append(part.data.numel())
        return part, offset

    monkeypatch.setattr(gguf_file, "_covering_blocks", counting)
    previous = set_tp_group(LocalRank(1, 2))
    try:
        from_slices = _load_rank_model(tiny_gguf, lazy=True, packed=packed).state_dict()
        matrix_bytes = sum(t.n_bytes for t in gguf.GGUFReader(tiny_gguf[0]).tensors if len(t.shape) == 2)
        assert sum(read) == matrix_bytes // 2  # every matrix is split in two: half of its bytes
        from_whole = _load_rank_model(tiny_gguf, lazy=False, packed=packed).state_dict()
    finally:
        set_tp_group(previous)
    assert from_slices.keys() == from_whole.keys()
    assert all(torch.equal(from_slices[k], from_whole[k]) for k in from_slices)


def test_a_pipeline_stage_reads_no_other_stages_layers(tiny_gguf, monkeypatch):
    read = set()
    narrow = GGUFSlice.narrow
    monkeypatch.setattr(GGUFSlice, "narrow", lambda self, *args: read.add(self.name) or narrow(self, *args))
    previous = set_pp_group(PipelineParallelGroup(stage=2, size=3, world_rank=2))  # the last of 3 layers
    try:
        _load_rank_model(tiny_gguf, lazy=None, packed=True)
    finally:
        set_pp_group(previous)
    assert read and {name.split(".")[2] for name in read if name.startswith("model.layers.")} == {"2"}


def test_row_parallel_slices_that_cut_blocks_load_as_float_rows(tmp_path):
    """96 intermediate features over two ranks: 48 a rank, not a multiple of Q8_0's 32-weight blocks."""
    from pagedllm.loader import load_hf_config, resolve_model
    from pagedllm.quantization.gguf import F32
    from tests.loader.tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny-i96-Q8_0.gguf", "Q8_0", intermediate_size=96)
    tiny = (path, load_hf_config(resolve_model(path)))
    previous = set_tp_group(LocalRank(1, 2))
    try:
        from_slices = _load_rank_model(tiny, lazy=True, packed=True)
        from_whole = _load_rank_model(tiny, lazy=False, packed=True).state_dict()
    finally:
        set_tp_group(previous)
    down = from_slices.model.layers[0].mlp.down_proj.weight
    assert [seg.qtype for seg in down.gguf_segments] == [F32]
    up = from_slices.model.layers[0].mlp.gate_up_proj.weight  # a column slice: whole rows, still packed
    assert [seg.qtype for seg in up.gguf_segments] == [int(GGMLQuantizationType.Q8_0)]
    assert all(torch.equal(v, from_whole[k]) for k, v in from_slices.state_dict().items())


def test_the_float_cache_is_read_as_slices_too(tiny_gguf, monkeypatch, tmp_path):
    from pagedllm.loader.weights import SafetensorsSlice

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    path, _ = tiny_gguf
    assert any(isinstance(w, GGUFSlice) for _, w in gguf_file.iter_gguf_weights(path, lazy=True))  # no cache yet
    whole = dict(gguf_file.iter_gguf_weights(path, lazy=False))  # a whole pass writes the float cache
    name = "model.layers.0.mlp.down_proj.weight"
    for n, w in gguf_file.iter_gguf_weights(path, lazy=True):  # used while the cache file is open
        if n == name:
            assert isinstance(w, SafetensorsSlice) and torch.equal(w.narrow(1, 64, 64), whole[name][:, 64:])
