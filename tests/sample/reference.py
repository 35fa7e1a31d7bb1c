"""Plain, loop-by-loop references for every logits transform (vLLM semantics), written for clarity
rather than speed: the tests compare our vectorised sampler against these on transformers' logits.
Each takes and returns one float32 row [V] (a copy; the input is never modified)."""

from __future__ import annotations

from collections import Counter

import torch

NEG_INF = float("-inf")


def ref_penalties(row: torch.Tensor, prompt: list[int], output: list[int], presence: float = 0.0,
                  frequency: float = 0.0, repetition: float = 1.0) -> torch.Tensor:
    row = row.clone()
    for t in set(prompt) | set(output):
        row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
    for t, count in Counter(output).items():
        row[t] -= frequency * count + presence
    return row


def ref_logit_bias(row: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    row = row.clone()
    for t, b in bias.items():
        row[t] += b
    return row


def ref_allowed(row: torch.Tensor, allowed: list[int]) -> torch.Tensor:
    out = torch.full_like(row, NEG_INF)
    for t in allowed:
        out[t] = row[t]
    return out


def ref_ban(row: torch.Tensor, tokens) -> torch.Tensor:
    row = row.clone()
    for t in tokens:
        row[t] = NEG_INF
    return row


def ref_bad_words(row: torch.Tensor, bad_words: list[list[int]], output: list[int]) -> torch.Tensor:
    banned = [w[-1] for w in bad_words if len(w) - 1 <= len(output) and output[len(output) - (len(w) - 1):] == w[:-1]]
    return ref_ban(row, banned)


def ref_probs(row: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
              min_p: float = 0.0) -> torch.Tensor:
    """Temperature -> min-p -> top-k (ties kept) -> top-p over what is left -> softmax."""
    logits = row / temperature
    vals = logits.tolist()
    order = sorted(range(len(vals)), key=lambda i: -vals[i])
    if min_p > 0:
        p = torch.softmax(logits, -1).tolist()
        threshold = min_p * max(p)
        order = [i for i in order if p[i] >= threshold]
    if 0 < top_k < len(order):
        kth = vals[order[top_k - 1]]
        order = [i for i in order if vals[i] >= kth]
    if top_p < 1.0:
        mass = torch.softmax(logits[order], -1).tolist()
        kept, before = [], 0.0
        for i, m in zip(order, mass):
            if before >= top_p:
                break
            kept.append(i)
            before += m
        order = kept
    masked = torch.full_like(logits, NEG_INF)
    masked[order] = logits[order]
    return torch.softmax(masked, -1)
