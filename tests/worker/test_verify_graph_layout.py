"""The verify CUDA graphs' batch layout, checked on the CPU.

A step of requests with at most ``1 + k`` queries each is staged as a uniform batch (every request
``1 + k`` queries, the leading ones dummies that write no KV; padding requests after them), which
is what a verify graph replays. Here the "graph" is an eager forward over exactly those staged
inputs (``EagerReplay``), so the padding, the dummy queries and the logits rows are checked end to
end against plain greedy decoding; the pure functions are checked on hand-made examples.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedllm.attention.backend import CommonAttentionInputs, forward_context
from pagedllm.worker.cuda_graph import MAX_VERIFY_GRAPH_TOKENS, CUDAGraphRunner, verify_capture_sizes
from pagedllm.worker.device_inputs import step_layout
from pagedllm.worker.input_prep import graph_shape, stage_uniform_batch
from tests.worker.test_runner_drafts import (  # noqa: F401  (the worker fixture)
    MAX_TOKENS,
    PROMPTS,
    JunkProposer,
    OracleProposer,
    full_sequences,
    generate,
    worker,
)


def test_verify_sizes_fit_the_token_budget():
    sizes = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 128, 256]
    assert verify_capture_sizes(sizes, 1, 8192) == []
    assert verify_capture_sizes(sizes, 4, 8192) == [s for s in sizes if 4 * s <= MAX_VERIFY_GRAPH_TOKENS]
    assert verify_capture_sizes(sizes, 6, 100) == [1, 2, 4, 8, 16]


def _fake_runner(q: int = 4) -> SimpleNamespace:
    sizes, verify = [1, 2, 4, 8], [1, 2, 4]
    return SimpleNamespace(max_size=8, max_verify_size=4, verify_query_len=q,
                           padded_size=lambda n, ql=1: next(s for s in (sizes if ql == 1 else verify) if s >= n))


def test_graph_shape_choice():
    runner = _fake_runner(q=4)
    lens = np.array([10, 20, 30])
    assert graph_shape(None, 3, 1, lens) == (None, 1)
    assert graph_shape(runner, 3, 1, lens) == (4, 1)  # pure decode: a decode graph
    assert graph_shape(runner, 3, 4, lens) == (4, 4)  # verification of up to 3 drafts
    assert graph_shape(runner, 3, 2, lens) == (4, 4)  # fewer drafts: padded with dummy queries
    assert graph_shape(runner, 3, 5, lens) == (None, 1)  # a longer query (prefill): eager
    assert graph_shape(runner, 5, 2, np.arange(5) + 10) == (None, 1)  # more requests than any verify graph
    assert graph_shape(runner, 3, 2, np.array([10, 3, 30])) == (None, 1)  # a context shorter than 1 + k
    assert graph_shape(runner, 9, 1, np.arange(9) + 10) == (None, 1)


def _stage(num_tokens: int, num_reqs: int) -> dict[str, np.ndarray]:
    fields, total = step_layout(num_tokens, num_reqs)
    buf = np.full(total, 0x7F, dtype=np.uint8)  # poison: every field must be written
    return {name: buf[off : off + n * dtype.itemsize].view(np.int64 if dtype.itemsize == 8 else np.int32)
            for name, (off, n, dtype) in fields.items()}


def test_uniform_batch_staging():
    """Two requests (rows 3 and 1) computing 2 and 3 tokens, q = 3, padded to 4 requests."""
    block_size, q, size = 4, 3, 4
    token_ids = np.arange(5 * 32).reshape(5, 32) + 1000
    block_table = np.arange(5 * 8, dtype=np.int32).reshape(5, 8)[::-1].copy()  # row r: its own blocks
    rows = np.array([3, 1])
    num_sched, seq_lens = np.array([2, 3]), np.array([9, 6])
    stage = _stage(size * q, size)
    first = stage_uniform_batch(stage, token_ids, block_table, block_size, rows, num_sched, seq_lens, q, size)
    assert first.tolist() == [1, 3]  # request 0: one dummy, then its 2 tokens; request 1: 3 tokens
    assert stage["query_start_loc"].tolist() == [0, 3, 6, 9, 12]
    assert stage["seq_lens"].tolist() == [9, 6, 3, 3]
    assert stage["rows"].tolist() == [3, 1, 0, 0]
    assert stage["positions"].tolist() == [6, 7, 8, 3, 4, 5, 0, 1, 2, 0, 1, 2]
    assert stage["input_ids"].tolist() == [token_ids[3, p] for p in (6, 7, 8)] + [
        token_ids[1, p] for p in (3, 4, 5)] + [token_ids[0, p] for p in (0, 1, 2)] * 2

    def slot(row, pos):
        return int(block_table[row, pos // block_size]) * block_size + pos % block_size

    assert stage["slot_mapping"].tolist() == [-1, slot(3, 7), slot(3, 8), slot(1, 3), slot(1, 4), slot(1, 5)] + [-1] * 6


class EagerReplay(CUDAGraphRunner):
    """A "graph" that runs the model eagerly over the staged inputs of the replayed shape: the
    same buffers, metadata shape and logits rows a captured graph has, on the CPU."""

    def __init__(self, cpu_worker, query_len: int) -> None:
        runner = cpu_worker.model_runner
        super().__init__(cpu_worker.model, cpu_worker.backend, runner.prep.inputs, runner.input_batch.max_num_reqs,
                         cpu_worker.device, verify_query_len=query_len, max_num_tokens=512)
        self.replays: list[tuple[int, int]] = []

    def replay(self, bs: int, q: int = 1) -> torch.Tensor:
        stage = self.inputs.np
        assert len(stage["seq_lens"]) == bs and len(stage["input_ids"]) == bs * q, "staged for another shape"
        dev = {name: torch.from_numpy(a) for name, a in stage.items()}
        common = CommonAttentionInputs(
            num_actual_tokens=bs * q, max_query_len=q, query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"], block_tables=self.inputs.block_tables[:bs], slot_mapping=dev["slot_mapping"],
            query_start_loc_host=stage["query_start_loc"], seq_lens_host=stage["seq_lens"])
        self.replays.append((bs, q))
        with forward_context(self.backend.metadata_builder.build(common), self.backend):
            return self._forward(dev["input_ids"], dev["positions"]).clone()


@pytest.fixture
def verify_graphs(worker):  # noqa: F811
    runner = worker.model_runner
    runner.graph_runner = graphs = EagerReplay(worker, query_len=5)
    yield graphs
    runner.graph_runner = None


@pytest.fixture(scope="module")
def expected(worker):  # noqa: F811
    return generate(worker, None)[0]


@pytest.mark.parametrize("corrupt", [None, 1])
def test_verify_layout_gives_the_greedy_tokens(worker, verify_graphs, expected, corrupt):  # noqa: F811
    got, _ = generate(worker, OracleProposer(full_sequences(expected), k=3, corrupt=corrupt))
    assert got == expected
    assert any(q == 5 for _, q in verify_graphs.replays), "no step ran in the verify layout"


def test_verify_layout_with_junk_drafts(worker, verify_graphs, expected):  # noqa: F811
    """Draft counts 0..4 in one step, with a prefill joining: the uniform layout where it fits."""
    got, _ = generate(worker, JunkProposer(k=4, seed=1), staggered=True)
    assert got == expected
    assert any(q == 5 for _, q in verify_graphs.replays)
    assert set(PROMPTS) == set(MAX_TOKENS)


def test_verify_graph_shapes_and_gemm_rows(worker):  # noqa: F811
    """Verify graphs next to the decode graphs: captured most tokens first, their token counts
    tuned as GEMM rows, their input views cached."""
    graphs = EagerReplay(worker, query_len=5)  # max_num_seqs 8
    assert graphs.sizes == [1, 2, 4, 8] and graphs.verify_sizes == [1, 2, 4, 8] and graphs.max_verify_size == 8
    assert graphs.shapes == [(8, 5), (4, 5), (2, 5), (8, 1), (1, 5), (4, 1), (2, 1), (1, 1)]
    assert graphs.token_counts == [1, 2, 4, 5, 8, 10, 20, 40]
    assert (40, 8) in graphs.inputs.recurring_shapes
    plain = CUDAGraphRunner(worker.model, worker.backend, worker.model_runner.prep.inputs, 8, worker.device)
    assert plain.verify_sizes == [] and plain.max_verify_size == 0 and plain.token_counts == [1, 2, 4, 8]
