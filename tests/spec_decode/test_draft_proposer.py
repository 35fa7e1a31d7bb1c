"""DraftModelProposer's batching, against a fake draft (``DraftSteps``) whose argmax after a token
is that token + 1: which forwards a step makes (one catch-up over every request, k - 1
single-token steps chained on the device), the catch-up's token budget, and its block pool."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.interface import ProposeInput

VOCAB = 1000


class FakeSteps:
    """Records each ``run`` and answers (last input token + 1) for every request."""

    def __init__(self, max_num_tokens: int = 512) -> None:
        self.max_num_tokens = max_num_tokens
        self.calls: list[dict] = []
        self.blocks: dict[int, list[int]] = {}

    def set_blocks(self, row: int, first_col: int, block_ids: list[int]) -> None:
        table = self.blocks.setdefault(row, [])
        assert len(table) == first_col
        table.extend(block_ids)

    def run(self, token_ids, block_table, rows, num_sched, seq_lens, last_token=None) -> torch.Tensor:
        assert int(num_sched.sum()) <= self.max_num_tokens
        for row, n in zip(rows.tolist(), seq_lens.tolist()):  # the blocks hold every computed position
            assert len(self.blocks[row]) * 4 >= n
            assert block_table[row, : len(self.blocks[row])].tolist() == self.blocks[row]
        self.calls.append(dict(rows=rows.tolist(), num_sched=num_sched.tolist(), seq_lens=seq_lens.tolist(),
                               chained=last_token is not None))
        last = last_token if last_token is not None else torch.from_numpy(token_ids[rows, seq_lens - 1])
        return (last + 1) % VOCAB


def make(k: int = 3, num_blocks: int = 64, max_num_tokens: int = 512) -> tuple[DraftModelProposer, FakeSteps]:
    steps = FakeSteps(max_num_tokens)
    return DraftModelProposer(steps, torch.device("cpu"), k, block_size=4, num_blocks=num_blocks, max_num_reqs=4,
                              max_model_len=64), steps


def inputs(seqs: dict[str, list[int]]) -> list[ProposeInput]:
    return [ProposeInput(req_id, np.asarray(t, dtype=np.int64), len(t)) for req_id, t in seqs.items()]


def test_one_catch_up_then_chained_single_token_steps():
    proposer, steps = make(k=3)
    seqs = {"a": [5, 6, 7, 8, 9], "b": [1, 2, 3, 4, 5, 6, 20]}
    assert proposer.propose(inputs(seqs)) == {"a": [10, 11, 12], "b": [21, 22, 23]}
    catch_up, *decodes = steps.calls
    assert catch_up["num_sched"] == [5, 7] and catch_up["seq_lens"] == [5, 7] and not catch_up["chained"]
    assert [c["seq_lens"] for c in decodes] == [[6, 8], [7, 9]]
    assert all(c["num_sched"] == [1, 1] and c["chained"] for c in decodes)


def test_catch_up_recomputes_from_the_first_rejected_draft():
    proposer, steps = make(k=3)
    seqs = {"a": [5, 6, 7, 8, 9], "b": [1, 2, 3, 4, 5, 6, 20]}
    proposer.propose(inputs(seqs))
    seqs["a"] += [10, 11, 12, 13]  # every draft accepted, plus the bonus token
    seqs["b"] += [21, 50]  # the second draft rejected
    steps.calls.clear()
    assert proposer.propose(inputs(seqs)) == {"a": [14, 15, 16], "b": [51, 52, 53]}
    # a: its KV held the drafts but the last (12 at position 7): positions 7 and 8 remain;
    # b: it held 21 at 7 and 22 at 8, where 50 was accepted instead: position 8 only.
    assert steps.calls[0]["num_sched"] == [2, 1] and steps.calls[0]["seq_lens"] == [9, 9]


def test_catch_up_keeps_to_the_token_budget():
    seqs = {"a": list(range(100, 111)), "b": list(range(200, 207)), "c": [1, 2, 3]}
    expected = make()[0].propose(inputs(seqs))
    proposer, steps = make(max_num_tokens=4)
    assert proposer.propose(inputs(seqs)) == expected
    catch_ups = [c for c in steps.calls if not c["chained"]]
    assert len(catch_ups) > 1 and sum(sum(c["num_sched"]) for c in catch_ups) == 11 + 7 + 3


def test_blocks_return_to_the_pool_and_a_short_pool_drafts_nothing():
    proposer, _ = make(k=3, num_blocks=4)
    seqs = {"a": list(range(10)), "b": list(range(10, 20))}  # 12 positions each: 3 blocks
    drafts = proposer.propose(inputs(seqs))
    assert list(drafts) == ["a"]  # b did not fit: no drafts, no blocks taken
    state = proposer.state
    assert "b" not in state.row_of or state.num_blocks[state.row_of["b"]] == 0
    proposer.remove_requests(["a", "b"])
    assert not state.row_of and sorted(state.free_blocks) == list(range(4))


def test_no_drafts_past_max_model_len():
    proposer, _ = make(k=3)
    drafts = proposer.propose(inputs({"a": list(range(62)), "b": list(range(64))}))
    assert drafts == {"a": [62, 63]}  # 2 positions left for a, none for b
