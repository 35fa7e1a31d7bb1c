"""Built-in logits processors, in vLLM's order: allowed ids -> bad words -> min_tokens -> bias -> penalties.

Each processor is built once per step from the rows' params and token history, holds only
tensors, and is a callable ``logits [B, V] -> logits`` (it may work in place). A processor
exists only when some row needs it, so a plain batch pays nothing. The host-side work is
per row and proportional to the row's own lists (allowed ids, bias entries, bad words, stop
ids), never to the vocabulary; the device work is a gather / index_put of those entries (plus
a fill of the rows that restrict allowed ids), never a [B, V] mask.
All of them run before temperature, so they also shape greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.sample.history import TokenHistory
from pagedllm.sample.penalties import build_penalties
from pagedllm.sample.transfer import host_to_device
from pagedllm.sampling_params import SamplingParams


@dataclass
class AllowedTokens:
    """Rows ``rows[i]`` keep only tokens ``ids[i]`` (padding repeats a real one); the rest -> -inf.
    Gather the kept logits, fill the rows, scatter them back: no [B, V] mask is built."""

    rows: torch.Tensor  # int64 [Br, 1]
    ids: torch.Tensor  # int64 [Br, W]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        kept = logits[self.rows, self.ids]
        logits[self.rows.squeeze(1)] = float("-inf")
        logits[self.rows, self.ids] = kept
        return logits


@dataclass
class BannedTokens:
    """(row, token) pairs set to -inf: bad-word completions and stop ids below min_tokens."""

    rows: torch.Tensor  # int64 [N]
    cols: torch.Tensor  # int64 [N]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logits[self.rows, self.cols] = float("-inf")
        return logits


@dataclass
class LogitBias:
    """(row, token, bias) triples added to the logits."""

    rows: torch.Tensor  # int64 [N]
    cols: torch.Tensor  # int64 [N]
    values: torch.Tensor  # float32 [N]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_put_((self.rows, self.cols), self.values, accumulate=True)


def build_logits_processors(
    params: list[SamplingParams], history: TokenHistory, vocab_size: int, device: torch.device
) -> list:
    """The processors this step needs, in application order (empty for a plain batch)."""
    procs: list = []
    allowed = _allowed_tokens(params, device)
    if allowed is not None:
        procs.append(allowed)
    banned = _banned_tokens(params, history, device)
    if banned is not None:
        procs.append(banned)
    bias = _logit_bias(params, device)
    if bias is not None:
        procs.append(bias)
    penalties = build_penalties(params, history, vocab_size, device)
    if penalties is not None:
        procs.append(penalties)
    return procs


def _allowed_tokens(params: list[SamplingParams], device: torch.device) -> AllowedTokens | None:
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return None
    width = max(len(params[i].allowed_token_ids) for i in rows)
    ids = [params[i].allowed_token_ids + [params[i].allowed_token_ids[0]] * (width - len(params[i].allowed_token_ids))
           for i in rows]
    return AllowedTokens(host_to_device(rows, torch.int64, device).unsqueeze(1), host_to_device(ids, torch.int64, device))


def _banned_tokens(params: list[SamplingParams], history: TokenHistory, device: torch.device) -> BannedTokens | None:
    pairs: list[tuple[int, int]] = []
    positions = history.output_positions
    for i, p in enumerate(params):
        if p.min_tokens and positions[i] < p.min_tokens:
            pairs.extend((i, t) for t in min_tokens_stop_ids(p))
        if p._bad_words_token_ids:
            pairs.extend((i, t) for t in bad_word_completions(p._bad_words_token_ids, history, i))
    if not pairs:
        return None
    rows, cols = zip(*pairs)
    return BannedTokens(host_to_device(list(rows), torch.int64, device), host_to_device(list(cols), torch.int64, device))


def min_tokens_stop_ids(p: SamplingParams) -> list[int]:
    """Tokens that would stop the request: its stop ids, and EOS unless ignore_eos."""
    ids = list(p.stop_token_ids)
    if not p.ignore_eos and p._eos_token_id is not None:
        ids.append(p._eos_token_id)
    return ids


def bad_word_completions(bad_words: list[list[int]], history: TokenHistory, i: int) -> list[int]:
    """Last tokens of the bad words whose other tokens end row i's output (vLLM: output only)."""
    longest = max(len(w) for w in bad_words)
    tail = history.output_tail(i, longest - 1)
    out = []
    for word in bad_words:
        prefix_len = len(word) - 1
        if prefix_len <= len(tail) and (prefix_len == 0 or tail[len(tail) - prefix_len:] == word[:-1]):
            out.append(word[-1])
    return out


def _logit_bias(params: list[SamplingParams], device: torch.device) -> LogitBias | None:
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return None
    r = [i for i in rows for _ in params[i].logit_bias]
    c = [t for i in rows for t in params[i].logit_bias]
    v = [b for i in rows for b in params[i].logit_bias.values()]
    return LogitBias(host_to_device(r, torch.int64, device), host_to_device(c, torch.int64, device),
                     host_to_device(v, torch.float32, device))
