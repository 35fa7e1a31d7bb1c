"""DeviceInputs: a step's flat inputs packed at fixed, aligned offsets and sent in one copy; the
views a CUDA graph captures for batch size bs are the ones a decode step of that size fills."""

import numpy as np
import pytest
import torch

from pagedllm import zero_copy
from pagedllm.worker.device_inputs import _ALIGN, _FLAT_FIELDS, DeviceInputs, step_layout


@pytest.mark.parametrize("num_tokens,num_reqs", [(1, 1), (37, 5), (256, 256), (16384, 256)])
def test_step_layout_packs_aligned_disjoint_fields(num_tokens, num_reqs):
    fields, total = step_layout(num_tokens, num_reqs)
    assert list(fields) == list(_FLAT_FIELDS)
    spans = []
    for name, (offset, length, dtype) in fields.items():
        key = _FLAT_FIELDS[name][1]
        assert length == {"tokens": num_tokens, "reqs": num_reqs, "reqs+1": num_reqs + 1}[key]
        assert dtype == _FLAT_FIELDS[name][0]
        assert offset % _ALIGN == 0
        spans.append((offset, offset + length * dtype.itemsize))
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= total < spans[-1][1] + _ALIGN


def test_staged_values_reach_the_step_tensors_on_cpu():
    inputs = DeviceInputs(max_tokens=64, max_reqs=8, max_blocks_per_req=4, device=torch.device("cpu"))
    stage = inputs.begin_step(10, 3)
    assert {name: len(a) for name, a in stage.items()}["input_ids"] == 10
    assert len(stage["query_start_loc"]) == 4 and stage["seq_lens"].dtype == np.int32
    stage["input_ids"][:] = np.arange(10)
    stage["query_start_loc"][:] = [0, 4, 9, 10]
    dev = inputs.copy_to_device()
    assert dev["input_ids"].tolist() == list(range(10))
    assert dev["query_start_loc"].dtype == torch.int32 and dev["query_start_loc"].tolist() == [0, 4, 9, 10]
    assert inputs.begin_step(4, 4) is inputs.begin_step(4, 4), "decode-shaped views are built once"
    with pytest.raises(ValueError, match="exceeds the input buffers"):
        inputs.begin_step(65, 1)
    with pytest.raises(ValueError, match="exceeds the input buffers"):
        inputs.begin_step(8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_copy_fills_the_views_a_graph_captures():
    inputs = DeviceInputs(max_tokens=512, max_reqs=64, max_blocks_per_req=4, device=torch.device("cuda"))
    captured = inputs.device_views(16, 16)  # what a graph of batch size 16 would read
    for step in range(3):  # both host staging sets
        stage = inputs.begin_step(16, 16)
        stage["input_ids"][:] = np.arange(16) + 100 * step
        stage["seq_lens"][:] = np.arange(16, dtype=np.int32) + step
        dev = inputs.copy_to_device()
        assert dev["input_ids"].data_ptr() == captured["input_ids"].data_ptr()
        assert all(t.data_ptr() % 16 == 0 for t in dev.values())
        torch.cuda.synchronize()
        assert captured["input_ids"].tolist() == [i + 100 * step for i in range(16)]
        assert captured["seq_lens"].tolist() == [i + step for i in range(16)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens,num_reqs", [(1, 1), (256, 256), (8192, 256)])
def test_every_staged_byte_arrives(num_tokens, num_reqs):
    """Decode-sized steps travel by the zero-copy kernel, prefill-sized ones (over
    zero_copy.MAX_FETCH_BYTES) by a copy; both must deliver the whole layout, on both host sets."""
    inputs = DeviceInputs(max_tokens=8192, max_reqs=256, max_blocks_per_req=4, device=torch.device("cuda"))
    total = step_layout(num_tokens, num_reqs)[1]
    for step in range(2):
        stage = inputs.begin_step(num_tokens, num_reqs)
        for i, a in enumerate(stage.values()):
            a[:] = np.arange(len(a)) * 7 + i + 1000 * step
        dev = inputs.copy_to_device()
        torch.cuda.synchronize()
        for name, a in stage.items():
            assert np.array_equal(dev[name].cpu().numpy(), a), name
    assert (total > zero_copy.MAX_FETCH_BYTES) == (num_tokens == 8192)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [4, 8192])  # the zero-copy kernel, the copy engine
def test_a_host_set_is_not_rewritten_before_the_gpu_read_it(num_tokens):
    """Steps that sample nothing give the engine no reason to wait for the GPU, so the CPU can stage
    step N+2 into step N's host set while step N's copy is still queued: begin_step must wait."""
    inputs = DeviceInputs(max_tokens=8192, max_reqs=4, max_blocks_per_req=4, device=torch.device("cuda"))
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the copies below
    snapshots = []
    for step in range(3):  # step 2 reuses step 0's host set
        stage = inputs.begin_step(num_tokens, 4)
        stage["input_ids"][:] = step
        dev = inputs.copy_to_device()
        snapshots.append(dev["input_ids"].clone())  # stream-ordered: what this step's forward would read
    torch.cuda.synchronize()
    assert [int(s.unique().item()) for s in snapshots] == [0, 1, 2]
