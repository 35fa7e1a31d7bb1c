"""Built-in logits processors, in vLLM's order: allowed ids -> bad words -> min_tokens -> bias -> penalties.

Each processor is built once per step from the rows' params and token history, holds only
tensors, and is a callable ``logits [B, V] -> logits`` (it may work in place). A processor
exists only when some row needs it, so a plain batch pays nothing. The host-side work is
per row and proportional to the row's own lists (allowed ids, bias entries, bad words, stop
ids), never to the vocabulary; the device work is one masked_fill / index_put per processor.
All of them run before temperature, so they also shape greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.sample.history import TokenHistory
from pagedllm.sample.penalties import build_penalties
from pagedllm.sampling_params import SamplingParams


@dataclass
class AllowedTokens:
    """Rows with ``allowed_token_ids``: every other token -> -inf. ``banned`` is bool [B, V]."""

    banned: torch.Tensor

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill_(self.banned, float("-inf"))


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
    allowed = _allowed_tokens(params, vocab_size, device)
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


def _allowed_tokens(params: list[SamplingParams], vocab_size: int, device: torch.device) -> AllowedTokens | None:
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return None
    banned = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)
    banned[torch.tensor(rows, device=device)] = True
    r = [i for i in rows for _ in params[i].allowed_token_ids]
    c = [t for i in rows for t in params[i].allowed_token_ids]
    banned[torch.tensor(r, device=device), torch.tensor(c, device=device)] = False
    return AllowedTokens(banned)


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
    return BannedTokens(torch.tensor(rows, dtype=torch.int64, device=device),
                        torch.tensor(cols, dtype=torch.int64, device=device))


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
    return LogitBias(torch.tensor(r, dtype=torch.int64, device=device), torch.tensor(c, dtype=torch.int64, device=device),
                     torch.tensor(v, dtype=torch.float32, device=device))
