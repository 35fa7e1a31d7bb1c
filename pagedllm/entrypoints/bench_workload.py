"""The synthetic request sets the benchmarks run: random prompts, or DESIGN.md's nano-bench."""

from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


def make_workload(kind: str, num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  vocab_limit: int, seed: int) -> Workload:
    if kind == "nano":
        random.seed(0)
        prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
        max_tokens = [random.randint(100, 1024) for _ in range(256)]
        return Workload(prompts, max_tokens)
    rng = random.Random(seed)
    prompts = [[rng.randint(0, vocab_limit - 1) for _ in range(rng.randint(*input_len))] for _ in range(num_requests)]
    max_tokens = [rng.randint(*output_len) for _ in range(num_requests)]
    return Workload(prompts, max_tokens)
