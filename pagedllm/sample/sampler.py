"""Vectorised sampling over the batch: logits -> (token ids, logprobs).

One pass for the whole batch, no Python loop over the vocabulary: logits processors (penalties,
bias, masks) -> temperature -> top-k / top-p / min-p masks -> draw. Greedy rows take the argmax.
Random rows draw by the exponential race (argmax of p / E with E ~ Exp(1)), which equals sampling
from p. Rows with a seed draw their noise from a generator seeded by (seed, output position), so
a seeded request produces the same tokens whatever else is in the batch and across preemption.

Logprobs follow vLLM's default ("raw logprobs"): log_softmax of the model's logits before any
processing. Cost: O(B*V) elementwise work, plus one sort of [B, V] only when some row uses
top-k/top-p.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs for one step (rows = requests that sample this step)."""

    temperature: torch.Tensor  # float32 [B]; 1.0 on greedy rows (they ignore it)
    greedy: torch.Tensor  # bool [B]
    all_greedy: bool
    top_k: torch.Tensor | None  # int64 [B], 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # float32 [B]; None when no row uses it
    min_p: torch.Tensor | None  # float32 [B]; None when no row uses it
    seeded_rows: list[tuple[int, int]] = field(default_factory=list)  # (row, per-step seed)
    max_num_logprobs: int | None = None  # largest k among rows that asked for logprobs
    logits_processors: list = field(default_factory=list)  # callables (logits) -> logits, in place ok


def build_sampling_metadata(
    params: list[SamplingParams], output_positions: list[int], device: torch.device
) -> SamplingMetadata:
    """Gather the per-request knobs into tensors. ``output_positions[i]`` is the index of the token
    row i is about to produce (its number of output tokens so far)."""
    greedy = [p.temperature < 1e-5 for p in params]
    temps = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
    use_top_k = any(p.top_k > 0 for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    use_min_p = any(p.min_p > 0.0 for p in params)
    seeded = [
        (i, _step_seed(p.seed, pos))
        for i, (p, pos, g) in enumerate(zip(params, output_positions, greedy))
        if p.seed is not None and not g
    ]
    k = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=torch.tensor(temps, dtype=torch.float32, device=device),
        greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
        all_greedy=all(greedy),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device) if use_top_k else None,
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device) if use_top_p else None,
        min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device) if use_min_p else None,
        seeded_rows=seeded,
        max_num_logprobs=max(k) if k else None,
    )


def _step_seed(seed: int, position: int) -> int:
    return ((seed * _SEED_MIX) ^ (position * 0xBF58476D1CE4E5B9) ^ 0x94D049BB133111EB) & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [B]
    # Only when some row asked for logprobs: [B, 1 + k] ids/logprobs (column 0 = sampled), ranks [B].
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


class Sampler:
    """Stateless apart from the generator used for unseeded random rows."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        for proc in meta.logits_processors:
            logits = proc(logits)
        token_ids = self._sample(logits, meta)
        out = SamplerOutput(token_ids=token_ids)
        if raw_logprobs is not None:
            self._gather_logprobs(raw_logprobs, token_ids, meta.max_num_logprobs, out)
        return out

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy_ids = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy_ids
        logits = logits / meta.temperature.unsqueeze(1)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = torch.softmax(logits, dim=-1)
        if meta.min_p is not None:
            keep = probs >= meta.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs * keep
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, seed in meta.seeded_rows:
            gen = torch.Generator(device=probs.device)
            gen.manual_seed(seed)
            noise[row].exponential_(generator=gen)
        random_ids = (probs / noise).argmax(dim=-1)
        return torch.where(meta.greedy, greedy_ids, random_ids)

    @staticmethod
    def _gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int, out: SamplerOutput) -> None:
        sampled = logprobs.gather(1, token_ids.unsqueeze(1))
        out.sampled_ranks = (logprobs > sampled).sum(dim=-1) + 1
        if k > 0:
            top_lp, top_ids = logprobs.topk(k, dim=-1)
            out.logprob_token_ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1)
            out.logprobs = torch.cat([sampled, top_lp], dim=1)
        else:
            out.logprob_token_ids = token_ids.unsqueeze(1)
            out.logprobs = sampled


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus. top_k 0 = off."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
        mask |= torch.arange(vocab, device=logits.device).unsqueeze(0) >= k.unsqueeze(1)
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (keeps at least one).
        mass_before = probs.cumsum(dim=-1) - probs
        mask |= mass_before >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
