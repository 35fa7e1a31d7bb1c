"""Beam search as vLLM exposes it: ``LLM.beam_search(prompts, BeamSearchParams(...))``.

The search is ``beam_search_steps``, a generator of steps that any engine front drives:
``run_beam_search`` with a blocking step (``LLM.beam_search``), ``run_beam_search_async`` with an
awaitable one (``engine/async_beam_search.py``, the server's ``use_beam_search``). Every step runs
each live beam as a one-token request asking for ``2 * beam_width`` logprobs, so the beams of a
prompt share their common prefix's KV blocks through the prefix cache. A beam's score is its
cumulative logprob divided by ``len(tokens) ** length_penalty`` (tokens = prompt + generated, a
final EOS not counted), as vLLM.
This module holds only the plain data types (no torch), so ``import pagedllm`` stays cheap."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field

from pagedllm.outputs import Logprob


@dataclass
class BeamSearchParams:
    """Beam search knobs (vLLM's names). Invalid values raise ValueError naming the field."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    # When a prompt's search ends once ``beam_width`` beams have finished: True at once; False
    # when no live beam can beat the worst of them at its current length (vLLM V0's heuristic);
    # "never" runs to max_tokens (or until no beam is live).
    early_stopping: bool | str = "never"

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` are prompt + generated ids; ``text`` is their decoding (set at the end)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` finished beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class BeamSearchInstance:
    """Search state of one prompt: live beams and those that ended with EOS."""

    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


def get_beam_search_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """Length-normalised score: ``cum_logprob / len ** length_penalty``; a final EOS is not counted."""
    length = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cum_logprob / (max(length, 1) ** length_penalty)


# One search step: the token ids of each live beam -> its candidate next tokens with their logprobs
# (an empty dict when the beam cannot go on).
StepFn = Callable[[list[list[int]]], list[dict[int, Logprob]]]
AsyncStepFn = Callable[[list[list[int]]], Awaitable[list[dict[int, Logprob]]]]
# The search as a coroutine of its steps: it yields the live beams' token ids, is sent their
# candidates, and returns the outputs. The sync and async drivers below only run the steps.
BeamSearchSteps = Generator[list[list[int]], list[dict[int, Logprob]], list[BeamSearchOutput]]


def run_beam_search(step: StepFn, prompts: list[list[int]], params: BeamSearchParams, eos_token_id: int | None,
                    max_model_len: int, decode: Callable[[list[int]], str] | None = None) -> list[BeamSearchOutput]:
    """Beam search over every prompt at once, each step run by ``step`` (see ``beam_search_steps``)."""
    search = beam_search_steps(prompts, params, eos_token_id, max_model_len, decode)
    try:
        beams = next(search)
        while True:
            beams = search.send(step(beams))
    except StopIteration as done:
        return done.value


async def run_beam_search_async(step: AsyncStepFn, prompts: list[list[int]], params: BeamSearchParams,
                                eos_token_id: int | None, max_model_len: int,
                                decode: Callable[[list[int]], str] | None = None) -> list[BeamSearchOutput]:
    """``run_beam_search`` with an awaitable step (an asyncio engine front)."""
    search = beam_search_steps(prompts, params, eos_token_id, max_model_len, decode)
    try:
        beams = next(search)
        while True:
            beams = search.send(await step(beams))
    except StopIteration as done:
        return done.value


def beam_search_steps(prompts: list[list[int]], params: BeamSearchParams, eos_token_id: int | None,
                      max_model_len: int, decode: Callable[[list[int]], str] | None = None) -> BeamSearchSteps:
    """Beam search over every prompt at once (all live beams of all prompts form one batch per step).

    Per step each beam grows by each of its candidates; a candidate ending in EOS (unless
    ignore_eos) is finished, the others compete for the prompt's ``beam_width`` places by score.
    A prompt whose search is done (``early_stopping``) drops its live beams. At the end the
    finished and live beams compete together. A beam that ended with EOS has finish_reason "stop"
    and stop_reason the EOS id; the EOS stays in its ``tokens`` and ``text`` only with
    ``include_stop_str_in_output`` (as vLLM's beam search: the EOS is the stop "string").
    Cost: at most ``max_tokens`` steps, each on at most ``len(prompts) * beam_width`` beams.
    """
    def score(b: BeamSearchSequence) -> float:
        return get_beam_search_score(b.tokens, b.cum_logprob, eos_token_id, params.length_penalty)

    instances = [BeamSearchInstance([BeamSearchSequence(list(ids))]) for ids in prompts]
    for _ in range(params.max_tokens):
        for inst in instances:  # beams that filled the context can only end here
            full = [b for b in inst.beams if len(b.tokens) >= max_model_len]
            inst.completed.extend(full)
            inst.beams = [b for b in inst.beams if len(b.tokens) < max_model_len]
        live = [(inst, beam) for inst in instances for beam in inst.beams]
        if not live:
            break
        candidates = yield [beam.tokens for _, beam in live]
        grown: dict[int, list[BeamSearchSequence]] = {id(inst): [] for inst in instances}
        for (inst, beam), cands in zip(live, candidates):
            for token_id, lp in cands.items():
                child = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [cands], beam.cum_logprob + lp.logprob)
                if token_id == eos_token_id and not params.ignore_eos:
                    child.finish_reason, child.stop_reason = "stop", eos_token_id
                    inst.completed.append(child)
                else:
                    grown[id(inst)].append(child)
        for inst in instances:
            inst.beams = sorted(grown[id(inst)], key=score, reverse=True)[: params.beam_width]
            if _search_done(inst, params, score):
                inst.beams = []
    outputs = []
    for inst in instances:
        best = sorted(inst.completed + inst.beams, key=score, reverse=True)[: params.beam_width]
        for beam in best:
            beam.finish_reason = beam.finish_reason or "length"
            if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
                beam.tokens = beam.tokens[:-1]  # the EOS that ended it (its logprob stays counted)
            beam.text = decode(beam.tokens) if decode is not None else None
        outputs.append(BeamSearchOutput(best))
    return outputs


def _search_done(inst: BeamSearchInstance, params: BeamSearchParams,
                 score: Callable[[BeamSearchSequence], float]) -> bool:
    """vLLM V0's early-stopping rule, checked once ``beam_width`` beams have finished."""
    if params.early_stopping == "never" or len(inst.completed) < params.beam_width or not inst.beams:
        return False
    if params.early_stopping is True:
        return True
    worst_kept = sorted(map(score, inst.completed), reverse=True)[params.beam_width - 1]
    return worst_kept >= max(map(score, inst.beams))
