"""Stop strings and n > 1 siblings through the whole engine, with and without async scheduling.

Both are settled inside the scheduler's update (stop strings through the engine's stop checker,
siblings as a request group), so the engine never calls back into the core after a step. On the
CPU, ``EngineArgs(async_scheduling=True)`` keeps one step in flight exactly as on CUDA: a request
stopped by a stop string must not emit the token of the step that was in flight.
"""

from __future__ import annotations

import random

import pytest

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from tests.helpers import make_tiny_model

VOCAB = 49152


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(folder, request):
    return LLMEngine.from_engine_args(EngineArgs(
        model=folder, dtype="float32", max_model_len=256, max_num_seqs=8, async_scheduling=request.param,
    ))


def prompt(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def drain(engine: LLMEngine) -> dict[str, object]:
    """Step until idle, checking the scheduler and the block pool after every step."""
    finished = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.request_id not in finished, "output after finishing"
            if out.finished:
                finished[out.request_id] = out
        engine.engine_core.scheduler.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.engine_core.scheduler.block_pool.get_usage() == 0.0
    return finished


def test_stop_string_ends_at_its_token_and_emits_nothing_after(engine):
    ids = prompt(1)
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine.add_request("full", {"prompt_token_ids": ids}, SamplingParams(**greedy))
    full = drain(engine)["full"].outputs[0]
    tokenizer = engine.get_tokenizer()
    # A stop string that the text reaches only at a later token: cut there.
    k = 12
    stop = tokenizer.decode(full.token_ids[k : k + 2]).strip()[:4]
    assert stop and stop in full.text
    engine.add_request("cut", {"prompt_token_ids": ids}, SamplingParams(stop=[stop], **greedy))
    cut = drain(engine)["cut"].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    n = len(cut.token_ids)
    assert cut.token_ids == full.token_ids[:n] and n < len(full.token_ids)
    assert stop in tokenizer.decode(full.token_ids[:n]) and stop not in tokenizer.decode(full.token_ids[: n - 1])


def test_streamed_stop_string_never_shows_trimmed_text(engine):
    ids = prompt(2)
    greedy = dict(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("full", {"prompt_token_ids": ids}, SamplingParams(**greedy))
    full = drain(engine)["full"].outputs[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    engine.add_request("s", {"prompt_token_ids": ids}, SamplingParams(stop=[stop], output_kind=1, **greedy))
    pieces = []
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        pieces += [o.outputs[0].text for o in engine.step()]
    assert "".join(pieces) == full.text[: full.text.index(stop)]


@pytest.mark.parametrize("n", [1, 3])
def test_n_siblings_wait_for_the_prompt_and_share_its_blocks(engine, n):
    ids = prompt(3, 70)
    scheduler = engine.engine_core.scheduler
    engine.add_request("one", {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    single = drain(engine)["one"].outputs[0].token_ids
    scheduler.reset_prefix_cache()
    hits_before = scheduler.stats().prefix_cache_hits
    engine.add_request("g", {"prompt_token_ids": ids}, SamplingParams(n=n, temperature=0.0, max_tokens=6, ignore_eos=True))
    assert engine.get_num_unfinished_requests() == n
    out = drain(engine)["g"]
    assert [c.token_ids for c in out.outputs] == [single] * n
    block = engine.config.cache_config.block_size
    assert scheduler.stats().prefix_cache_hits - hits_before == (n - 1) * (len(ids) // block) * block


def test_abort_of_a_group_with_held_siblings(engine):
    ids = prompt(4, 70)
    engine.add_request("g", {"prompt_token_ids": ids}, SamplingParams(n=3, max_tokens=5))
    engine.abort_request("g")
    outs = engine.step()
    assert [o.request_id for o in outs] == ["g"] and outs[0].finished
    assert all(c.finish_reason == "abort" for c in outs[0].outputs)
    drain(engine)
    assert engine.get_num_unfinished_requests() == 0
