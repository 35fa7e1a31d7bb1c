"""SamplingParams: every generation knob of a request, validated at construction.

Field names, defaults and accepted ranges follow vLLM so that user code moves over unchanged.
Invalid values raise ``ValueError`` (or ``TypeError`` for a wrong type) whose message starts with
the field's name, so the HTTP server can report the offending parameter.
"""

from __future__ import annotations

import copy
import enum
import json
from dataclasses import dataclass, field
from typing import Any

# A temperature below this means greedy decoding (the one definition; the sampler uses it too).
GREEDY_TEMPERATURE_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a streaming consumer holds."""

    CUMULATIVE = 0  # all text/token ids so far (default for the step() loop)
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # a single output when the request finishes


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's ``StructuredOutputsParams``): exactly one of
    ``json`` (a JSON schema, as a dict or a JSON string), ``regex``, ``choice`` (the text is one of
    these strings), ``grammar`` (EBNF as xgrammar reads it: a ``root ::= ...`` rule) or
    ``json_object=True`` (any JSON object).

    ``disable_any_whitespace`` makes JSON compact (no free whitespace between tokens).
    ``whitespace_pattern`` is vLLM's field for backends that take a whitespace regex; xgrammar
    (the only backend here) has none, so it is refused rather than ignored.

    Invariant: after ``__post_init__`` exactly one constraint is set and each has its type (a dict
    ``json`` stays a dict); whether the schema, regex or grammar *parses* is checked by the engine
    at ``add_request`` (it needs the grammar library), which raises ``ValueError`` naming the field.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object, "
                f"got {kinds or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise TypeError(f"json must be a JSON schema (a dict or a JSON string), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"choice must be a non-empty list of strings, got {self.choice!r}")
            if not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"choice must contain only strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"json_object must be True when set, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"disable_any_whitespace must be a boolean, got {self.disable_any_whitespace!r}")
        if self.whitespace_pattern is not None:
            raise ValueError("whitespace_pattern is not supported by the xgrammar backend "
                             "(use disable_any_whitespace for compact JSON)")

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple:
        """(kind, spec, options): equal for constraints that compile to the same grammar (a dict
        schema and its JSON string with the same content share one key)."""
        kind = self.kind
        if kind == "json":
            spec = _canonical_json(self.json)
        elif kind == "choice":
            spec = tuple(self.choice)
        else:
            spec = getattr(self, kind)
        return (kind, spec, self.disable_any_whitespace)


CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _canonical_json(schema: str | dict) -> str:
    """The schema as sorted, compact JSON (a string that is not JSON stays as is: it is refused
    when the engine parses it)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return schema
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


@dataclass
class SamplingParams:
    """Sampling parameters for one request (vLLM-compatible).

    Invariant: after ``__post_init__`` every field is in range and normalised
    (``stop`` is a list, ``stop_token_ids`` a list, greedy requests have top_p=1, top_k=0, min_p=0).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    truncate_prompt_tokens: int | None = None
    # Constrained decoding (JSON schema, regex, choice, grammar); see StructuredOutputsParams.
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine from the tokenizer (token id sequences of ``bad_words``).
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    # Filled by the engine: the model's EOS id (min_tokens suppresses it in the sampler).
    _eos_token_id: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._normalise()
        self._verify()
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            # Greedy: the other knobs that shape the distribution are irrelevant.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    # -- construction helpers -------------------------------------------------------------
    def _normalise(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.bad_words is not None:
            self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"logit_bias must map token ids to floats, got {self.logit_bias!r}") from e
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.output_kind, RequestOutputKind):
            self.output_kind = RequestOutputKind(self.output_kind)

    def _verify(self) -> None:  # noqa: C901 - a flat list of range checks reads best
        _check_int("n", self.n, minimum=1)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, minimum=1)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n, got best_of={self.best_of}, n={self.n}")
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty, 0.0, None, low_open=True)
        _check_number("temperature", self.temperature, 0.0, None)
        _check_number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, minimum=0, hint="(-1 or 0 disables it)")
        _check_number("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=None)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens}, max_tokens={self.max_tokens}"
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, minimum=1)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain non-empty strings, got {s!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched in the text)")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, minimum=0)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, minimum=0)
        if self.logit_bias is not None:
            for t in self.logit_bias:
                _check_int("logit_bias", t, minimum=0)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(f"structured_outputs must be StructuredOutputsParams, got "
                            f"{type(self.structured_outputs).__name__}")

    # -- derived properties ---------------------------------------------------------------
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def verify_vocab(self, vocab_size: int) -> None:
        """Check token ids in the params against the model's vocabulary (called by the engine)."""
        for name, ids in (
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("logit_bias", list((self.logit_bias or {}).keys())),
            ("stop_token_ids", self.stop_token_ids),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} contains token ids outside the vocabulary (size {vocab_size}): {bad[:5]}")


def _check_int(name: str, value: Any, minimum: int | None, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}{' ' + hint if hint else ''}, got {value}")


def _check_number(
    name: str, value: Any, low: float | None, high: float | None, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value:  # NaN
        raise ValueError(f"{name} must not be NaN")
    if low is not None and (value <= low if low_open else value < low):
        rng = f"({low}" if low_open else f"[{low}"
        raise ValueError(f"{name} must be in {rng}, {high if high is not None else 'inf'}], got {value}")
    if high is not None and value > high:
        lb = "(" if low_open else "["
        raise ValueError(f"{name} must be in {lb}{low}, {high}], got {value}")
