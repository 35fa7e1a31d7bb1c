"""The xgrammar backend: a constraint -> a parsed grammar (validation) -> a compiled grammar -> matchers.

Three costs, paid in three places:
- ``parse`` (about a millisecond for a JSON schema): on the caller's thread at ``add_request``, so
  a bad schema, regex or grammar raises ``ValueError`` naming the field before the engine keeps
  any state for the request;
- ``compile`` (milliseconds to seconds: the token masks of every grammar state over the
  vocabulary): on the manager's thread pool, off the engine loop;
- ``GrammarMatcher`` (microseconds): one per request, when it is first scheduled.

Per step, the tokens the constrained requests sampled in the step before are accepted by
``batch_accept`` (one call into xgrammar's batched accept, without the GIL; it can split the
batch over helper threads, which measured slower on one H100 host: 4.0 ms against 1.1 ms per
step at 256 requests, so it does not by default), then their bitmask rows are filled by one
``BatchGrammarMatcher`` call that runs on up to ``MAX_FILL_THREADS`` of xgrammar's own threads
without the GIL, while the engine thread processes outputs and schedules (engine_core.py).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import xgrammar as xgr

from pagedllm.cpu_threads import usable_cpus
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.jump_forward import JumpForward


class XgrammarBackend:
    """Parses and compiles constraints for one tokenizer.

    Invariant: ``_compiler`` (built once, under ``_lock``) belongs to this tokenizer and vocabulary
    width. xgrammar's compiler is thread-safe; its own cache is disabled because the manager
    caches compiled grammars by constraint (one entry per (kind, spec)).
    """

    def __init__(self, tokenizer, vocab_size: int, max_threads: int = 2) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_threads = max_threads
        self._compiler: xgr.GrammarCompiler | None = None
        self._info: xgr.TokenizerInfo | None = None  # built once, under _lock
        self._lock = threading.Lock()
        self._batch: xgr.BatchGrammarMatcher | None = None  # the per-step fill's thread pool
        self.fill_threads = max(1, min(MAX_FILL_THREADS, usable_cpus() - 1))  # its size, read when built
        # batch_accept's helpers (none by default: measured slower on one H100 host, module doc);
        # with k, the engine thread takes one chunk and they take the others
        self.accept_threads = 0
        self._accept_pool: ThreadPoolExecutor | None = None

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(self._tokenizer_info(), max_threads=self.max_threads,
                                                     cache_enabled=False)
            return self._compiler

    def _tokenizer_info(self) -> xgr.TokenizerInfo:
        if self._info is None:
            self._info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
        return self._info

    def new_jump_forward(self) -> JumpForward:
        """A ``JumpForward`` for this tokenizer (jump_forward.py): its encoder and token bytes."""
        with self._lock:
            return JumpForward.from_tokenizer(self.tokenizer, self._tokenizer_info())

    @staticmethod
    def parse(params: StructuredOutputsParams) -> xgr.Grammar:
        """The grammar of ``params``; ``ValueError`` starting with the field's name if it does not
        parse (an invalid JSON schema, regex or EBNF grammar)."""
        kind = params.kind
        try:
            if kind == "json":
                return xgr.Grammar.from_json_schema(_schema_text(params.json),
                                                    any_whitespace=not params.disable_any_whitespace)
            if kind == "regex":
                return xgr.Grammar.from_regex(params.regex)
            if kind == "choice":
                return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
            if kind == "grammar":
                return xgr.Grammar.from_ebnf(params.grammar)
            # vLLM's json_object (OpenAI's {"type": "json_object"}): a JSON object, not any value.
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=not params.disable_any_whitespace)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"{kind} is not a valid {_WHAT[kind]}: {_first_line(e)}") from e

    def compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        return self.compiler.compile_grammar(grammar)

    def batch_fill_bitmask(self, matchers: list[xgr.GrammarMatcher], bitmask, rows: list[int]) -> None:
        """Fill ``bitmask[rows[i]]`` with the next-token mask of ``matchers[i]``, in parallel."""
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=self.fill_threads)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def batch_accept(self, matchers: list[xgr.GrammarMatcher], token_ids: list[int], helpers: bool = True) -> list[int]:
        """Give ``token_ids[i]`` to ``matchers[i]``; the indices of those that refused theirs.

        xgrammar's batched accept runs without the GIL but on one thread, and an accept inside a
        JSON string costs microseconds (a byte-wise walk of the token through the grammar), so
        a large batch is split into chunks of at least ``MIN_ACCEPT_CHUNK`` matchers, accepted at
        once on the accept threads and the caller's own (the caller waits: the GIL is free for
        the workers to enter and leave xgrammar). ``helpers=False``: one call on this thread."""
        num_chunks = min(self.accept_threads + 1, len(matchers) // MIN_ACCEPT_CHUNK) if helpers else 1
        if num_chunks <= 1:
            return _accept_chunk(matchers, token_ids)
        if self._accept_pool is None:
            self._accept_pool = ThreadPoolExecutor(self.accept_threads, thread_name_prefix="pagedllm-accept")
        bounds = [len(matchers) * c // num_chunks for c in range(num_chunks + 1)]
        futures = [self._accept_pool.submit(_accept_chunk, matchers[lo:hi], token_ids[lo:hi])
                   for lo, hi in zip(bounds[1:-1], bounds[2:])]
        refused = _accept_chunk(matchers[:bounds[1]], token_ids[:bounds[1]])
        for lo, future in zip(bounds[1:-1], futures):
            refused += [lo + i for i in future.result()]
        return refused

    def shutdown(self) -> None:
        if self._accept_pool is not None:
            self._accept_pool.shutdown(wait=False)

    @staticmethod
    def new_matcher(compiled: xgr.CompiledGrammar, stop_token_ids: list[int] | None) -> xgr.GrammarMatcher:
        """A matcher at the grammar's start. ``stop_token_ids``: the tokens that end the text (the
        request's EOS and stop token ids), accepted only once the grammar is complete; None keeps the tokenizer's."""
        return xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)


# At most this many threads fill a step's bitmask: 256 rows of a JSON schema take well under a
# millisecond on 4, hidden behind the engine thread's work, and more of them only compete with
# the engine thread for cores while they run.
MAX_FILL_THREADS = 4
MIN_ACCEPT_CHUNK = 32  # fewer matchers than this per thread: the hand-off costs more than it saves
MAX_ACCEPT_THREADS = 7


def _accept_chunk(matchers: list[xgr.GrammarMatcher], token_ids: list[int]) -> list[int]:
    """``batch_accept`` on one thread: the indices of the matchers that refused their token.

    Through the binding behind ``BatchGrammarMatcher.batch_accept_token`` where this xgrammar has
    it: the public wrapper converts the answer to a list element by element (about 2 us each,
    holding the GIL: more than the accepts), while the binding's array answers ``0 in`` natively,
    so the usual all-accepted answer costs one call."""
    if _core_batch_accept is None:
        accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers, token_ids)
        return [i for i, ok in enumerate(accepted) if not ok]
    accepted = _core_batch_accept([m._handle for m in matchers], token_ids, False)
    if 0 not in accepted:
        return []
    return [i for i, ok in enumerate(accepted) if not ok]


def _private_batch_accept():
    """xgrammar's binding of the batched accept (a private name: None where a release moved it;
    ``_accept_chunk`` then takes the public wrapper)."""
    try:
        from xgrammar.matcher import _core

        return _core.BatchGrammarMatcher.batch_accept_token
    except (ImportError, AttributeError):
        return None


_core_batch_accept = _private_batch_accept()


_WHAT = {"json": "JSON schema", "regex": "regular expression", "choice": "list of choices",
         "grammar": "EBNF grammar", "json_object": "JSON grammar"}


def _schema_text(schema: str | dict) -> str:
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON ({e})") from e
        return schema
    return json.dumps(schema)


def choice_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"``: each choice as an EBNF string literal (JSON escapes, which
    xgrammar's EBNF reads)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _first_line(error: Exception) -> str:
    """xgrammar's messages start with a source location ("[12:00:00] /project/cpp/x.cc:10: ...")."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
