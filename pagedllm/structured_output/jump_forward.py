"""Jump-forward decoding: where the grammar admits exactly one continuation, append its tokens
without sampling them one by one.

After each sampled token the request's matcher is asked for its jump-forward string (xgrammar's
``find_jump_forward_string``: the longest text every completion of the grammar continues with,
e.g. ``"name": "`` after ``{`` in a compact JSON schema). Its tokens are appended to the request's
output in the same update as the sampled token (the detokenizer, the stop strings and the stream
see them together); they have no KV yet, so the scheduler's one rule computes them in the next
step as a short prompt-like run before it samples again: a jump of k tokens saves k decode steps.

How the jump string becomes tokens (the choice that keeps the output valid):
- The sampled tokens stay as sampled; the jump string is tokenized on its own (no special
  tokens). The text is therefore exactly what the grammar forces; what can differ from the
  tokenizer's canonical tokenization of the whole output is where a jump meets its neighbours: a
  token the model would have merged across the boundary (``{"`` sampled, then ``name`` jumped,
  where encoding ``{"name`` might give other pieces). The model then conditions on a split it
  did not produce itself; the text, and so its validity, is unaffected. Re-encoding the sampled
  token together with the jump (SGLang's way) would rewrite a token the client may already have
  streamed, and with async scheduling a token whose KV is being computed.
- The tokenizer's own tokens are used when they spell exactly the string's bytes (byte-level BPE
  tokenizers, SmolLM2's and Llama 3's among them, always do); otherwise (a tokenizer that prepends
  a space to a text it encodes, as SentencePiece's ``▁`` does) the greedy longest-match
  tokenization over the vocabulary's byte strings.
- The matcher must accept every token: the jump stops before the first one it refuses (the text
  of a special token such as ``<|im_end|>`` inside a key, which the tokenizer maps to its id).
- ``max_tokens`` and ``max_model_len`` truncate a jump (the request then finishes with
  "length"). Jumped tokens are output tokens: they count towards ``min_tokens`` (a jump never
  holds a stop token) and are matched against stop strings like sampled ones.
- Logprobs: a jumped token was never sampled, so it has no distribution to report. vLLM, which
  has no jump-forward, returns logprobs for every token; so a request that asks for logprobs (or
  a ``best_of`` ranking, which reads them) is never jumped here: it samples every token.
"""

from __future__ import annotations

from collections.abc import Sequence


class JumpForward:
    """Turns jump-forward strings into token ids for one tokenizer, and counts the jumps.

    Invariant: ``_cache`` maps a jump string to the tokens that spell exactly its bytes (at most
    ``max_cached`` strings; cleared when full: the strings of one schema repeat in every request
    that uses it, so the cache refills at once). ``_by_bytes`` (built on the first string the
    tokenizer cannot spell) maps each non-special token's bytes to its lowest id.
    Cost: a cached string is a dict lookup; a new one is one tokenizer call and a byte comparison
    (tens of microseconds); the longest-match fallback is O(len(string) * longest token) lookups.
    Counters: ``num_jumps`` (jumps of at least one token) and ``num_jumped_tokens``.
    """

    def __init__(self, encode, token_bytes: Sequence[bytes], special_token_ids: Sequence[int],
                 max_cached: int = 4096) -> None:
        self._encode = encode  # text -> token ids, without special tokens
        self._token_bytes = token_bytes
        self._special = frozenset(special_token_ids)
        self._cache: dict[str, list[int]] = {}
        self._max_cached = max_cached
        self._by_bytes: dict[bytes, int] | None = None
        self._longest = 0
        self.num_jumps = 0
        self.num_jumped_tokens = 0

    @classmethod
    def from_tokenizer(cls, tokenizer, tokenizer_info) -> JumpForward:
        """For an HF tokenizer and its xgrammar ``TokenizerInfo`` (the bytes of each token)."""
        special = {*tokenizer_info.special_token_ids, *getattr(tokenizer, "all_special_ids", ())}
        return cls(lambda text: tokenizer.encode(text, add_special_tokens=False),
                   tokenizer_info.decoded_vocab, sorted(special))

    def tokenize(self, text: str) -> list[int]:
        """Token ids whose bytes are exactly ``text``'s (module doc); may be empty when some byte
        has no token of its own."""
        token_ids = self._cache.get(text)
        if token_ids is None:
            token_ids = self._encode(text)
            if b"".join(self._token_bytes[t] for t in token_ids) != text.encode():
                token_ids = self._longest_match(text.encode())
            if len(self._cache) >= self._max_cached:
                self._cache.clear()
            self._cache[text] = token_ids
        return token_ids

    def _longest_match(self, data: bytes) -> list[int]:
        """Greedy longest-match tokenization of ``data`` over the non-special tokens; stops at the
        first byte no token starts with."""
        if self._by_bytes is None:
            self._by_bytes = {}
            for token_id, piece in enumerate(self._token_bytes):
                if piece and token_id not in self._special:
                    self._by_bytes.setdefault(piece, token_id)
            self._longest = max(map(len, self._by_bytes), default=0)
        token_ids, start = [], 0
        while start < len(data):
            for end in range(min(len(data), start + self._longest), start, -1):
                token_id = self._by_bytes.get(data[start:end])
                if token_id is not None:
                    token_ids.append(token_id)
                    start = end
                    break
            else:
                break
        return token_ids

    def record(self, num_tokens: int) -> None:
        if num_tokens:
            self.num_jumps += 1
            self.num_jumped_tokens += num_tokens
