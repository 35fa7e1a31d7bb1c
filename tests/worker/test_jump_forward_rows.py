"""The runner's side of jump-forward: ``InputBatch.replace_tokens`` writes the jumped tokens over
a request's row and supersedes the token in flight, whose step's late result must then leave the
row alone even when a newer step has already launched a sample for it."""

from __future__ import annotations

import torch

from pagedllm import SamplingParams
from pagedllm.core.sched_output import NewRequestData
from pagedllm.sample.output import SamplerOutput
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.step_handle import StepHandle


def launch(batch: InputBatch, row: int, token_id: int) -> StepHandle:
    handle = StepHandle(batch, ["r"], [0])
    handle.launch_copies(SamplerOutput(torch.tensor([token_id])), [row], [batch.params[row]])
    return handle


def row_tokens(batch: InputBatch, row: int) -> list[int]:
    return batch.token_ids[row, : batch.num_tokens[row]].tolist()


def test_a_superseded_sample_never_reaches_the_row():
    batch = InputBatch(max_num_reqs=2, max_model_len=32, max_blocks_per_req=8)
    row = batch.add(NewRequestData("r", [1, 2, 3], [], SamplingParams(), [0], 0))
    superseded = launch(batch, row, 7)  # in flight: samples at position 3
    batch.replace_tokens(row, 3, [40, 41])  # a jump put its tokens there instead
    assert row_tokens(batch, row) == [1, 2, 3, 40, 41] and batch.num_pending[row] == 0
    newer = launch(batch, row, 9)  # the next step samples after the jump
    assert superseded.result().sampled_token_ids == [[7]]  # reported (the scheduler drops it) ...
    assert row_tokens(batch, row) == [1, 2, 3, 40, 41] and batch.num_pending[row] == 1  # ... not applied
    newer.result()
    assert row_tokens(batch, row) == [1, 2, 3, 40, 41, 9] and batch.num_pending[row] == 0


def test_a_superseded_sample_already_applied_is_overwritten():
    batch = InputBatch(max_num_reqs=2, max_model_len=32, max_blocks_per_req=8)
    row = batch.add(NewRequestData("r", [1, 2, 3], [], SamplingParams(), [0], 0))
    launch(batch, row, 7).result()  # applied before the runner heard of the jump
    batch.replace_tokens(row, 3, [40, 41])
    assert row_tokens(batch, row) == [1, 2, 3, 40, 41] and batch.num_pending[row] == 0
