"""OutputProcessor: EngineCoreOutputs -> RequestOutputs (detokenization, stop strings, logprobs, n).

Holds one RequestState per live sequence and one ParentRequest per user request with n > 1.
Stop strings are matched in the detokenized text (across token boundaries) by
``check_stop_strings``, which the scheduler calls from inside its update for the sequences that
have stop strings: a match finishes the sequence there, at the token that completes it, before
its next step is scheduled. The detokenizer state stays here; the core only sees token ids and
the answer. While a stop string could still be forming at the end of the text, that tail is held
back from streamed outputs (unless include_stop_str_in_output), so no consumer ever sees text
that is later trimmed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedllm.core.sched_output import EngineCoreOutput, TokenLogprobs
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.request import Request
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

_FINAL_ONLY = RequestOutputKind.FINAL_ONLY  # Enum attribute access is slow in the per-step loop


@dataclass
class ParentRequest:
    """A user request fanned out into ``len(children)`` sequences (n, or best_of when set)."""

    request_id: str
    params: SamplingParams
    children: list[str]
    n: int
    finished: set[str] = field(default_factory=set)


class RequestState:
    """One sequence's output so far. With ``hide_logprobs`` (best_of's internal logprobs=0, not
    asked for by the user) only the cumulative logprob is kept, for ranking, and none is reported.

    ``request`` is the scheduler's record of the sequence: its arrival and first-scheduled times
    are read from it for ``RequestMetrics``; the token times are stamped here, once per step.
    """

    def __init__(self, request_id, parent_id, index, prompt, prompt_token_ids, params: SamplingParams,
                 tokenizer, output_kind: RequestOutputKind, hide_logprobs: bool = False,
                 request: Request | None = None) -> None:
        self.request_id = request_id
        self.request = request
        self.arrival_time = request.arrival_time if request is not None else time.time()
        self.parent_id = parent_id
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output_kind = output_kind
        self.detok = (
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens,
                                   params.spaces_between_special_tokens)
            if params.detokenize and tokenizer is not None else None
        )
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""
        self.hide_logprobs = hide_logprobs
        self.logprobs: list[dict[int, Logprob]] | None = (
            [] if params.logprobs is not None and not hide_logprobs else None
        )
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.cumulative_logprob = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.sent_tokens = 0
        self.sent_text = 0
        # When this sequence got its first / latest tokens and finished (the step's one time stamp).
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.hold_back = 0 if params.include_stop_str_in_output or not params.stop else max(map(len, params.stop)) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: EngineCoreOutput, now: float) -> None:
        """Apply one step's output, stamped ``now``. The text of a sequence with stop strings was
        already added by ``add_text_until_stop`` (during the core's update)."""
        new_ids = out.new_token_ids
        if new_ids:
            if self.first_token_time is None:
                self.first_token_time = now
            self.last_token_time = now
        self.token_ids.extend(new_ids)
        self.num_cached_tokens = out.num_cached_tokens
        if out.new_logprobs and self.cumulative_logprob is not None:
            for lp in out.new_logprobs:
                self.cumulative_logprob += lp.logprobs[0]
                if self.logprobs is not None:
                    self.logprobs.append(self._to_logprob_dict(lp))
        if out.new_prompt_logprobs and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(self._to_logprob_dict(lp) for lp in out.new_prompt_logprobs)
        finish_reason = out.finish_reason
        if self.detok is not None and new_ids and not self.params.stop:
            if finish_reason == "stop" and not self.params.include_stop_str_in_output:
                new_ids = new_ids[:-1]  # the EOS / stop id that ended it stays out of the text (vLLM)
            if new_ids:
                self.text += self.detok.add_tokens(new_ids)
        if finish_reason is not None:
            self.finish_reason, self.stop_reason = finish_reason, out.stop_reason
            self.finished_time = now

    def add_text_until_stop(self, new_ids: list[int], stopped_on_token: bool) -> tuple[int, str] | None:
        """Detokenize a step's tokens of a sequence with stop strings, one token at a time.

        Returns None, or (number of ``new_ids`` up to the one that completes a stop string, the
        stop string); the text then ends at the match and the later tokens are never added.
        ``stopped_on_token``: the last id stopped the sequence (EOS / stop id), so it is not text.
        Stop strings are looked for only once ``min_tokens`` tokens have been generated (vLLM): the
        text of the first ``min_tokens`` tokens is never searched, only text after it (a stop
        string may start inside it and end after it).
        """
        if stopped_on_token and not self.params.include_stop_str_in_output:
            new_ids = new_ids[:-1]
        num_before = len(self.token_ids)  # this step's tokens are appended to token_ids later (update)
        min_tokens = self.params.min_tokens
        for i, token_id in enumerate(new_ids):
            delta = self.detok.add_tokens([token_id])
            if num_before + i + 1 <= min_tokens:
                self.text += delta
                continue
            stop = self._append_text(delta)
            if stop is not None:
                return i + 1, stop
        return None

    def _append_text(self, delta: str) -> str | None:
        """Append ``delta``; return the stop string it completes (the text is cut there), if any.
        Only matches that end inside ``delta`` count: the text before it was searched already,
        or was not to be searched (min_tokens)."""
        if not delta:
            return None
        old_len = len(self.text)
        self.text += delta
        for stop in self.params.stop:
            idx = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if idx != -1:
                end = idx + len(stop) if self.params.include_stop_str_in_output else idx
                self.text = self.text[:end]
                return stop
        return None

    def _to_logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        d: dict[int, Logprob] = {}
        for tid, val, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
            if tid not in d:
                d[tid] = Logprob(val, rank, self._decode_token(tid))
        return d

    def _decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None or not self.params.detokenize:
            return None
        return self.tokenizer.decode([token_id])

    def first_scheduled_time(self) -> float | None:
        return self.request.first_scheduled_time if self.request is not None else None

    def completion(self) -> CompletionOutput:
        """The CompletionOutput to send now, honouring the output kind (cumulative / delta)."""
        visible = len(self.text) if self.finished else max(self.sent_text, len(self.text) - self.hold_back)
        if self.output_kind == RequestOutputKind.DELTA:
            text = self.text[self.sent_text : visible]
            token_ids = self.token_ids[self.sent_tokens :]
            logprobs = self.logprobs[self.sent_tokens :] if self.logprobs is not None else None
        else:
            text, token_ids, logprobs = self.text[:visible], list(self.token_ids), self.logprobs
            logprobs = list(logprobs) if logprobs is not None else None
        self.sent_text, self.sent_tokens = visible, len(self.token_ids)
        return CompletionOutput(
            index=self.index, text=text, token_ids=token_ids,
            cumulative_logprob=None if self.hide_logprobs else self.cumulative_logprob,
            logprobs=logprobs, finish_reason=self.finish_reason, stop_reason=self.stop_reason,
        )


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}
        # Tokens generated per user request since the last ``take_step_tokens`` (every output kind,
        # FINAL_ONLY included): what the serving metrics count. None until ``record_step_tokens``, so
        # LLM.generate does not pay for it.
        self._step_tokens: dict[str, list[int]] | None = None
        # The time stamp of the latest ``process_outputs``: every token time of that step (the
        # serving histograms read it, so they and RequestMetrics share one clock reading).
        self.step_time = time.time()

    def record_step_tokens(self) -> None:
        """From now on, count each step's new tokens per user request (see ``take_step_tokens``)."""
        if self._step_tokens is None:
            self._step_tokens = {}

    def take_step_tokens(self) -> dict[str, tuple[int, int]]:
        """``{user request id: (tokens generated since the last call, prompt length)}``, then reset
        (empty when not recording)."""
        if not self._step_tokens:
            return {}
        taken, self._step_tokens = self._step_tokens, {}
        return {rid: (n, prompt_len) for rid, (n, prompt_len) in taken.items()}

    def add_request(self, state: RequestState, parent: ParentRequest | None = None) -> None:
        self.states[state.request_id] = state
        if parent is not None:
            self.parents[parent.request_id] = parent

    def has_request(self, request_id: str) -> bool:
        return request_id in self.states or request_id in self.parents

    def child_ids(self, request_id: str) -> list[str]:
        """The sequence ids behind a user request id (itself when n == 1)."""
        if request_id in self.parents:
            return list(self.parents[request_id].children)
        return [request_id] if request_id in self.states else []

    def check_stop_strings(self, request_id: str, new_token_ids: list[int], stopped_on_token: bool) -> tuple[int, str] | None:
        """The scheduler's stop checker (``core.scheduler.StopChecker``): detokenize a sequence's
        new tokens and find its stop strings (``RequestState.add_text_until_stop``)."""
        state = self.states.get(request_id)
        if state is None or state.detok is None:
            return None
        return state.add_text_until_stop(new_token_ids, stopped_on_token)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """Request outputs to hand to the user.

        A FINAL_ONLY sequence that has not finished produces no output (``_make_output`` would
        return None for it or its parent), so it is not even looked at: the common case of
        ``LLM.generate`` costs one ``update`` per sequence per step.
        """
        touched: dict[str, None] = {}
        states = self.states
        counts = self._step_tokens
        self.step_time = now = time.time()
        for out in outputs:
            state = states.get(out.req_id)
            if state is None or state.finish_reason is not None:
                continue
            if counts is not None and out.new_token_ids:
                count = counts.setdefault(state.parent_id or state.request_id, [0, len(state.prompt_token_ids)])
                count[0] += len(out.new_token_ids)
            state.update(out, now)
            if state.finish_reason is None and state.output_kind == _FINAL_ONLY:
                continue
            touched[state.parent_id or state.request_id] = None
        if not touched:
            return []
        return [ro for rid in touched if (ro := self._make_output(rid)) is not None]

    def finish_aborted(self, request_ids: list[str]) -> list[RequestOutput]:
        """Mark user requests aborted; return their final outputs (finish_reason "abort")."""
        results = []
        now = time.time()
        for rid in request_ids:
            for cid in self.child_ids(rid):
                st = self.states[cid]
                if not st.finished:
                    st.finish_reason, st.stop_reason, st.finished_time = "abort", None, now
            ro = self._make_output(rid)
            if ro is not None:
                results.append(ro)
        return results

    def _make_output(self, user_request_id: str) -> RequestOutput | None:
        parent = self.parents.get(user_request_id)
        child_ids = parent.children if parent else [user_request_id]
        children = [self.states[c] for c in child_ids]
        finished = all(c.finish_reason is not None for c in children)
        first = children[0]
        if not finished and (first.output_kind == _FINAL_ONLY
                             or (parent is not None and parent.n < len(children))):
            return None  # best_of > n streams nothing: which sequences survive is known at the end
        metrics = _request_metrics(children, finished)
        if parent is not None and finished and parent.n < len(children):
            # best_of: keep the n sequences with the highest cumulative logprob, best first.
            children = sorted(children, key=lambda s: s.cumulative_logprob or 0.0, reverse=True)[: parent.n]
        completions = [c.completion() for c in children]
        if parent is not None and finished and parent.n < len(child_ids):
            for i, comp in enumerate(completions):
                comp.index = i
        if finished:
            for c in child_ids:
                self.states.pop(c, None)
            self.parents.pop(user_request_id, None)
        return RequestOutput(
            request_id=user_request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs, outputs=completions, finished=finished,
            num_cached_tokens=first.num_cached_tokens, metrics=metrics,
        )


def _request_metrics(states: list[RequestState], finished: bool) -> RequestMetrics:
    """A user request's timings from its sequences' (n > 1: the earliest first schedule and first
    token, the latest token; it finished when its last sequence did). Built for every output, so
    the one-sequence case (nearly every output) takes the short path."""
    arrival = states[0].arrival_time
    if len(states) == 1:
        s = states[0]
        first_scheduled = s.first_scheduled_time()
        first_token, last_token, finished_time = s.first_token_time, s.last_token_time, s.finished_time
    else:
        first_scheduled = _earliest(s.first_scheduled_time() for s in states)
        first_token = _earliest(s.first_token_time for s in states)
        last_tokens = [s.last_token_time for s in states if s.last_token_time is not None]
        last_token = max(last_tokens) if last_tokens else None
        finished_time = max(s.finished_time for s in states) if finished else None
    return RequestMetrics(
        arrival_time=arrival, last_token_time=last_token, first_scheduled_time=first_scheduled,
        first_token_time=first_token, time_in_queue=None if first_scheduled is None else first_scheduled - arrival,
        finished_time=finished_time,
    )


def _earliest(times) -> float | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None
