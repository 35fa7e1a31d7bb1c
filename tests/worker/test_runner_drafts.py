"""Multi-token steps on the CPU: the runner driven directly with hand-made SchedulerOutputs.

A proposer that drafts the next tokens of the known greedy continuation, one that drafts junk, and
one that is right only in part must all give the tokens of plain greedy decoding; the right one in
fewer steps. Also: the bitmask hook between ``execute_model`` and ``sample_tokens``, and the sync
policy's reasons to wait."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedllm import EngineArgs, SamplingParams
from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.engine.config_builder import create_engine_config
from pagedllm.sample.bitmask import GrammarOutput
from pagedllm.spec_decode.interface import ProposeInput
from pagedllm.worker.sync_policy import StepSyncPolicy
from pagedllm.worker.worker import Worker
from tests.helpers import make_tiny_model

BLOCK_SIZE = 4
NUM_BLOCKS = 256


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    path = make_tiny_model("qwen3", tmp_path_factory.mktemp("tiny"))
    config = create_engine_config(EngineArgs(model=path, dtype="float32", skip_tokenizer_init=True, device="cpu",
                                             block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS,
                                             max_num_seqs=8, max_model_len=128))
    w = Worker(config)
    w.initialize_kv_cache(NUM_BLOCKS)
    return w


class HandScheduler:
    """A minimal synchronous scheduler: every live request is scheduled every step (its whole
    uncomputed part plus the drafts the runner proposed last step), with blocks to spare."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.free_blocks = list(range(NUM_BLOCKS))
        self.reqs: dict[str, dict] = {}
        self.finished: set[str] = set()
        self.num_steps = 0

    def add(self, req_id: str, prompt: list[int], max_tokens: int, **params) -> None:
        self.reqs[req_id] = dict(tokens=list(prompt), prompt_len=len(prompt), computed=0, blocks=[], drafts=[],
                                 new=True, max_tokens=max_tokens,
                                 params=SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))

    def outputs(self, req_id: str) -> list[int]:
        r = self.reqs[req_id]
        return r["tokens"][r["prompt_len"] : r["prompt_len"] + r["max_tokens"]]

    def step(self, grammar_output=None):
        so = SchedulerOutput(finished_req_ids=set(self.finished))
        self.finished.clear()
        live = {i: r for i, r in self.reqs.items() if len(r["tokens"]) - r["prompt_len"] < r["max_tokens"]}
        for req_id, r in live.items():
            num_new = len(r["tokens"]) - r["computed"] + len(r["drafts"])
            new_blocks = []
            while len(r["blocks"]) * BLOCK_SIZE < r["computed"] + num_new:
                new_blocks.append(self.free_blocks.pop())
                r["blocks"].append(new_blocks[-1])
            if r["new"]:
                so.scheduled_new_reqs.append(NewRequestData(req_id, r["tokens"][: r["prompt_len"]], [], r["params"],
                                                            list(r["blocks"]), r["computed"]))
                r["new"] = False
            else:
                so.scheduled_cached_reqs.append(CachedRequestData(req_id, new_blocks, r["computed"]))
            so.num_scheduled_tokens[req_id] = num_new
            if r["drafts"]:
                so.scheduled_spec_decode_tokens[req_id] = list(r["drafts"])
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        self.runner.execute_model(so)
        out = self.runner.sample_tokens(grammar_output).result()
        self.num_steps += 1
        for req_id, tokens in zip(out.req_ids, out.sampled_token_ids):
            r = live[req_id]
            rejected = len(r["drafts"]) - (len(tokens) - 1) if tokens else 0
            r["computed"] += so.num_scheduled_tokens[req_id] - rejected
            r["tokens"] += tokens
            r["drafts"] = (out.draft_token_ids or {}).get(req_id, [])
            if len(r["tokens"]) - r["prompt_len"] >= r["max_tokens"]:
                self.finished.add(req_id)
        return out


class OracleProposer:
    """Drafts the next ``k`` tokens of a known continuation (every draft right)."""

    def __init__(self, reference: dict[str, list[int]], k: int = 3, corrupt: int | None = None) -> None:
        self.reference, self.k, self.corrupt = reference, k, corrupt
        self.calls = 0

    def remove_requests(self, req_ids) -> None:
        pass

    def propose(self, requests: list[ProposeInput]) -> dict[str, list[int]]:
        self.calls += 1
        out = {}
        for r in requests:
            n, ref = len(r.token_ids), self.reference[r.req_id]
            assert r.token_ids.tolist()[: len(ref)] == ref[:n], "the proposer sees the accepted tokens"
            drafts = list(self.reference[r.req_id][n : n + self.k])
            if self.corrupt is not None and len(drafts) > self.corrupt:
                drafts[self.corrupt] = (drafts[self.corrupt] + 1) % 1000
            out[r.req_id] = drafts
        return out


class JunkProposer:
    def __init__(self, k: int = 4, seed: int = 0) -> None:
        self.k, self.rng = k, random.Random(seed)

    def remove_requests(self, req_ids) -> None:
        pass

    def propose(self, requests: list[ProposeInput]) -> dict[str, list[int]]:
        return {r.req_id: [self.rng.randrange(1000) for _ in range(self.rng.randint(0, self.k))] for r in requests}


PROMPTS = {"a": [5, 17, 300, 42, 8, 99, 4], "b": [7, 7, 123], "c": list(range(30, 49))}
MAX_TOKENS = {"a": 14, "b": 9, "c": 11}


def generate(worker, proposer, staggered: bool = True, **params) -> tuple[dict[str, list[int]], HandScheduler]:
    runner = worker.model_runner
    runner.proposer = proposer
    sched = HandScheduler(runner)
    try:
        sched.add("a", PROMPTS["a"], MAX_TOKENS["a"], **params)
        sched.add("b", PROMPTS["b"], MAX_TOKENS["b"])
        if not staggered:
            sched.add("c", PROMPTS["c"], MAX_TOKENS["c"])
        for step in range(100):
            if staggered and step == 3:  # a prefill joins steps that verify drafts
                sched.add("c", PROMPTS["c"], MAX_TOKENS["c"], **params)
            sched.step()
            if all(len(sched.outputs(i)) == MAX_TOKENS[i] for i in PROMPTS if i in sched.reqs) and len(sched.reqs) == 3:
                break
        sched.step()  # hands the finished requests back to the runner
    finally:
        runner.proposer = None
    return {i: sched.outputs(i) for i in PROMPTS}, sched


@pytest.fixture(scope="module")
def greedy(worker):
    return generate(worker, None)


def full_sequences(outputs: dict[str, list[int]]) -> dict[str, list[int]]:
    return {i: PROMPTS[i] + outputs[i] for i in PROMPTS}


def test_right_drafts_give_the_greedy_tokens_in_fewer_steps(worker, greedy):
    expected, plain = greedy
    proposer = OracleProposer(full_sequences(expected), k=3)
    got, sched = generate(worker, proposer)
    assert got == expected
    assert proposer.calls > 0 and sched.num_steps < plain.num_steps


@pytest.mark.parametrize("corrupt", [0, 1, 2])
def test_partly_right_drafts_give_the_greedy_tokens(worker, greedy, corrupt):
    expected, _ = greedy
    got, _ = generate(worker, OracleProposer(full_sequences(expected), k=3, corrupt=corrupt))
    assert got == expected


@pytest.mark.parametrize("seed", [0, 1])
def test_junk_drafts_give_the_greedy_tokens(worker, greedy, seed):
    expected, _ = greedy
    got, _ = generate(worker, JunkProposer(k=4, seed=seed), staggered=bool(seed))
    assert got == expected


def test_drafts_with_penalties_see_the_drafts_before_them(worker):
    """Each draft position is sampled over the request's tokens plus the drafts before it, so a
    repetition penalty gives the same tokens with and without drafts."""
    expected, _ = generate(worker, None, repetition_penalty=1.5, frequency_penalty=0.5)
    got, _ = generate(worker, OracleProposer(full_sequences(expected), k=3), repetition_penalty=1.5,
                      frequency_penalty=0.5)
    assert got == expected


def test_accepted_tokens_come_back_as_one_list_per_request(worker, greedy):
    """A step verifying 3 right drafts returns 4 tokens for that request, with their logprobs."""
    expected, _ = greedy
    runner = worker.model_runner
    runner.proposer = OracleProposer(full_sequences(expected), k=3)
    sched = HandScheduler(runner)
    try:
        sched.add("a", PROMPTS["a"], MAX_TOKENS["a"], logprobs=2)
        first = sched.step()  # the prefill: one token, then drafts for the next step
        assert first.sampled_token_ids == [expected["a"][:1]] and first.draft_token_ids == {"a": expected["a"][1:4]}
        second = sched.step()
        assert second.sampled_token_ids == [expected["a"][1:5]]
        assert [lp.token_ids[0] for lp in second.logprobs[0]] == expected["a"][1:5]
        assert all(len(lp.token_ids) == 3 for lp in second.logprobs[0])
    finally:
        runner.proposer = None
        sched.finished.update(sched.reqs)
        sched.reqs.clear()
        sched.step()


def test_bitmask_between_execute_and_sample_restricts_the_tokens(worker):
    runner = worker.model_runner
    vocab = worker.model.config.vocab_size
    sched = HandScheduler(runner)
    allowed = 4321
    mask = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)
    mask[0, allowed // 32] = np.int32(np.uint32(1 << (allowed % 32)).view(np.int32))
    sched.add("m", [1, 2, 3], 2)
    out = sched.step(GrammarOutput(["m"], mask))
    assert out.sampled_token_ids == [[allowed]]
    sched.step()
    sched.step()


def test_sync_policy_waits_only_for_a_reason():
    policy = StepSyncPolicy(8)
    pending = np.zeros(8, dtype=np.int64)
    rows = np.array([0, 3, 5])
    pending[[0, 3]] = 1
    assert not policy.must_wait(rows, pending, has_drafts=False)  # plain decode: tokens are forwarded
    assert policy.must_wait(rows, pending, has_drafts=True)
    policy.reads_history[5] = True
    assert not policy.must_wait(rows, pending, has_drafts=False)  # row 5 has nothing in flight
    policy.reads_history[3] = True
    assert policy.must_wait(rows, pending, has_drafts=False)
    policy.reads_history[:] = False
    policy.launched(np.array([0]))  # the step in flight verifies drafts for row 0
    assert policy.must_wait(rows, pending, has_drafts=False)
    assert not policy.must_wait(np.array([3]), pending, has_drafts=False)
    policy.launched(None)
    assert not policy.must_wait(rows, pending, has_drafts=False)
    assert not policy.must_wait(rows, np.zeros(8, dtype=np.int64), has_drafts=True)  # nothing to wait for


def test_warm_up_shapes_come_from_the_backend(worker):
    from pagedllm.attention.triton_backend import TritonBackend

    assert worker.backend.warmup_query_lens(100) == []  # the CPU backends compile nothing
    mixes = TritonBackend.warmup_query_lens(None, 10)
    assert mixes == [[1], [1, 1], [1, 2], [1, 4], [1, 8]]
    assert torch.device(worker.device).type == "cpu"
