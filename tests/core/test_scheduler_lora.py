"""LoRA in the scheduler (pure Python): at most ``max_loras`` distinct adapters run at once
(vLLM's rule: a waiting request whose adapter would exceed it is passed over, not the queue), and
the prefix cache is keyed by adapter (two adapters never share a KV block)."""

from __future__ import annotations

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import update_block_hashes
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.lora.request import LoRARequest
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

A1, A2, A3 = (LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in (1, 2, 3))


def make_scheduler(max_loras: int | None) -> Scheduler:
    return Scheduler(SchedulerConfig(8, 64, 256, max_loras=max_loras), CacheConfig(4, 64, True))


def request(req_id: str, lora: LoRARequest | None, prompt: list[int] | None = None, max_tokens: int = 2) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id, prompt or [5, 6, 7, 8, 9, 10, 11, 12, 13], params, None, lora_request=lora)


def run_step(scheduler: Scheduler) -> set[str]:
    """One step with a fake runner that samples token 1; returns the scheduled request ids."""
    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[1] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else []
               for r in ids]
    scheduler.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled))
    scheduler.check_integrity()
    return set(ids)


def test_no_step_runs_more_adapters_than_max_loras():
    scheduler = make_scheduler(max_loras=2)
    for req_id, lora in [("r1", A1), ("r2", A2), ("r3", A3), ("base", None), ("r1b", A1)]:
        scheduler.add_request(request(req_id, lora))
    first = run_step(scheduler)
    # a3 would be a third adapter: passed over; the base model and a1's second request are not.
    assert first == {"r1", "r2", "base", "r1b"}
    seen = [first]
    while scheduler.has_unfinished_requests():
        scheduled = run_step(scheduler)
        loras = {scheduler.requests[r].lora_request.lora_int_id for r in scheduled
                 if r in scheduler.requests and scheduler.requests[r].lora_request is not None}
        assert len(loras) <= 2
        seen.append(scheduled)
    assert any("r3" in s for s in seen), "the passed-over request ran once a slot's adapter finished"


def test_without_lora_the_queue_order_is_unchanged():
    scheduler = make_scheduler(max_loras=None)
    for req_id, lora in [("r1", A1), ("r2", A2), ("r3", A3)]:
        scheduler.add_request(request(req_id, lora))
    assert run_step(scheduler) == {"r1", "r2", "r3"}


def test_block_hashes_are_keyed_by_adapter():
    prompt = list(range(3, 15))
    hashes = {}
    for name, lora in [("base", None), ("a1", A1), ("a2", A2), ("a1-again", LoRARequest("x", 1, "/adapters/a1"))]:
        hashes[name] = update_block_hashes(request(name, lora, prompt), 4)
    assert len(hashes["base"]) == 3
    assert not set(hashes["base"]) & set(hashes["a1"]) and not set(hashes["a1"]) & set(hashes["a2"])
    assert hashes["a1"] == hashes["a1-again"]  # the id is the key


def test_prefix_cache_hits_only_the_same_adapter():
    scheduler = make_scheduler(max_loras=4)
    prompt = list(range(3, 20))
    scheduler.add_request(request("first", A1, prompt, max_tokens=1))
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    for req_id, lora in [("other", A2), ("base", None), ("same", A1)]:
        scheduler.add_request(request(req_id, lora, prompt, max_tokens=1))
    scheduler.schedule()
    hits = {r: scheduler.requests[r].num_cached_tokens for r in ("other", "base", "same")}
    assert hits == {"other": 0, "base": 0, "same": 16}
