"""Vectorised sampling over the batch: logits -> (token ids, logprobs).

One pass for the whole batch, in vLLM's order: raw logprobs (if asked) -> logits processors
(allowed ids, bad words, min_tokens, logit bias, penalties; see logits_processors.py) -> greedy
argmax -> temperature -> min-p -> top-k / top-p -> draw (torch_sampling.py; on the GPU rows
without masks take the fused inverse-CDF kernels of triton_sampling.py). Greedy rows take the argmax
of the processed logits. Rows with a seed draw their noise from a generator seeded by (seed,
output position), so a seeded request produces the same tokens whatever else is in the batch
and across preemption.

Logprobs follow vLLM's default ("raw logprobs"): log_softmax of the model's logits before any
processing. Cost: a few O(B*V) passes per enabled feature (no sort on the CPU: top-k / top-p
read one topk of a few hundred candidates). No host sync beyond reading the sampled ids (the
metadata is built on the host beforehand), except the rare top-p fallback on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm import zero_copy
from pagedllm.sample.history import TokenHistory
from pagedllm.sample.logits_processors import build_logits_processors
from pagedllm.sample.logprobs import gather_logprobs
from pagedllm.sample.output import SamplerOutput
from pagedllm.sample.torch_sampling import exponential_race, processed_probs
from pagedllm.sample.transfer import host_to_device, numpy_to_device
from pagedllm.sample.triton_sampling import categorical_sample, fused_available, greedy_argmax
from pagedllm.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs for one step (rows = requests that sample this step)."""

    # float32 [B], 1.0 on greedy rows (they ignore it), and bool [B]; both None when every row is
    # greedy (nothing reads them then: no host->device copies for an all-greedy step).
    temperature: torch.Tensor | None
    greedy: torch.Tensor | None
    all_greedy: bool
    top_k: torch.Tensor | None  # int64 [B], 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # float32 [B]; None when no row uses it
    min_p: torch.Tensor | None  # float32 [B]; None when no row uses it
    seeded_rows: list[tuple[int, int]] = field(default_factory=list)  # (row, per-step seed)
    max_num_logprobs: int | None = None  # largest k among rows that asked for logprobs
    # Callables (logits) -> logits, in place ok, applied in order before temperature. The built-in
    # ones (logits_processors.py) come first; callers may append their own.
    logits_processors: list = field(default_factory=list)
    max_top_k: int = 0  # largest top_k of any row (host copy: no device sync to size topk)
    all_random: bool = False  # no greedy row: the argmax pass is skipped


def build_sampling_metadata(
    params: list[SamplingParams], history: TokenHistory, device: torch.device, vocab_size: int
) -> SamplingMetadata:
    """Gather the per-request knobs into tensors; ``history`` holds row i's tokens so far (it also
    gives the output position each seeded row draws its noise for). Cost: O(B) host work plus
    whatever the needed logits processors cost (nothing for a plain batch)."""
    greedy = [p.temperature < GREEDY_TEMPERATURE_EPS for p in params]
    temps = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
    top_k = [p.top_k for p in params]
    use_top_p = any(p.top_p < 1.0 for p in params)
    use_min_p = any(p.min_p > 0.0 for p in params)
    positions = history.output_positions.tolist()
    seeded = [
        (i, _step_seed(p.seed, pos))
        for i, (p, pos, g) in enumerate(zip(params, positions, greedy))
        if p.seed is not None and not g
    ]
    k = [p.logprobs for p in params if p.logprobs is not None]
    all_greedy = all(greedy)
    return SamplingMetadata(
        temperature=None if all_greedy else host_to_device(temps, torch.float32, device),
        greedy=None if all_greedy else host_to_device(greedy, torch.bool, device),
        all_greedy=all_greedy,
        all_random=not any(greedy),
        top_k=host_to_device(top_k, torch.int64, device) if max(top_k, default=0) > 0 else None,
        top_p=host_to_device([p.top_p for p in params], torch.float32, device) if use_top_p else None,
        min_p=host_to_device([p.min_p for p in params], torch.float32, device) if use_min_p else None,
        seeded_rows=seeded,
        max_num_logprobs=max(k) if k else None,
        logits_processors=build_logits_processors(params, history, vocab_size, device),
        max_top_k=max(top_k, default=0),
    )


def _step_seed(seed: int, position: int) -> int:
    return ((seed * _SEED_MIX) ^ (position * 0xBF58476D1CE4E5B9) ^ 0x94D049BB133111EB) & 0x7FFF_FFFF_FFFF_FFFF


class Sampler:
    """Stateless apart from the generator used for unseeded random rows."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._seed_rng = np.random.default_rng(seed)  # per-step base seeds of the fused GPU draw

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row. May modify ``logits`` in place when it is already float32.
        A plain batch (no logprobs, no processors, no top-k/p/min-p) reads the logits in their own
        dtype: argmax and the fused kernel upcast exactly, so no float32 copy is made."""
        plain = meta.max_num_logprobs is None and not meta.logits_processors and (
            meta.all_greedy or (meta.top_k is None and meta.top_p is None and meta.min_p is None
                                and fused_available(logits)))
        if not plain:
            logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        for proc in meta.logits_processors:
            logits = proc(logits)
        token_ids, host_token_ids = self._sample(logits, meta)
        out = SamplerOutput(token_ids=token_ids, host_token_ids=host_token_ids)
        if raw_logprobs is not None:
            out.logprob_token_ids, out.logprobs, out.sampled_ranks = gather_logprobs(
                raw_logprobs, token_ids, meta.max_num_logprobs
            )
        return out

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token ids on the logits' device, and the same ids in pinned host memory when the fused
        kernel stored them there itself (zero copy), else None."""
        fused = fused_available(logits)
        if fused and (meta.all_greedy or (meta.top_k is None and meta.top_p is None and meta.min_p is None)):
            host = torch.empty(logits.shape[0], dtype=torch.int64, pin_memory=True) \
                if zero_copy.available(logits.device) else None
            if meta.all_greedy:
                return greedy_argmax(logits, host), host
            return categorical_sample(logits, meta.temperature, meta.greedy, self._row_seeds(meta, logits), host), host
        if meta.all_greedy:
            return logits.argmax(dim=-1), None
        probs = processed_probs(logits, meta.temperature, meta.top_k, meta.top_p, meta.min_p, meta.max_top_k)
        random_ids = exponential_race(probs, self.generator, meta.seeded_rows)
        if meta.all_random:
            return random_ids, None
        return torch.where(meta.greedy, logits.argmax(dim=-1), random_ids), None

    def _row_seeds(self, meta: SamplingMetadata, logits: torch.Tensor) -> torch.Tensor:
        """Philox seeds for the fused GPU draw: a fresh random base per step (drawn on the host) plus
        the row index; seeded rows use their own seed. One asynchronous host->device copy."""
        base = int(self._seed_rng.integers(0, 2**62))
        seeds = np.arange(base, base + logits.shape[0], dtype=np.int64)
        for row, seed in meta.seeded_rows:
            seeds[row] = seed
        return numpy_to_device(seeds, logits.device)
