"""Fast paths of the per-step output processing: they must not change what users get.

- ``OutputProcessor.process_outputs`` skips unfinished FINAL_ONLY sequences (``LLM.generate``'s kind):
  the outputs must equal what ``_make_output`` would build, for n == 1 and for n > 1 parents.
- ``IncrementalDetokenizer`` calls the Rust ``tokenizers`` decoder directly when the Hugging Face
  wrapper would return exactly its result, and falls back to ``tokenizer.decode`` otherwise.
"""

from __future__ import annotations

import copy

import pytest

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.detokenizer import IncrementalDetokenizer, backend_decode
from pagedllm.engine.output_processor import OutputProcessor, ParentRequest, RequestState
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from tests.helpers import default_tokenizer

TEXTS = [
    "Hello world, this is a test.",
    "Multi-byte: 日本語のテキスト, emoji 🤖🚀 and accents: café naïve.",
    "  leading spaces\nnew lines\n\n  and\ttabs  ",
]


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def run(kind: RequestOutputKind, n: int, tokenizer=None, steps: int = 5, tokens=None, step_tokens=None):
    """Sequences of one user request get one token per step (``tokens[step]`` for sequence 0, else
    100 + 10 * step + i); sequence i finishes at step steps - 1 - i. With ``step_tokens`` (a list),
    the processor records token counts and each step's ``take_step_tokens()`` is appended to it."""
    processor = OutputProcessor(tokenizer)
    if step_tokens is not None:
        processor.record_step_tokens()
    params = SamplingParams(max_tokens=steps, n=n, output_kind=kind, detokenize=tokenizer is not None)
    child_ids = ["r"] if n == 1 else [f"{i}_r" for i in range(n)]
    parent = ParentRequest("r", params, child_ids, n) if n > 1 else None
    for i, cid in enumerate(child_ids):
        processor.add_request(RequestState(cid, parent and "r", i, None, [1, 2, 3], params, tokenizer, kind), parent)
    per_step = []
    for step in range(steps):
        outs = [EngineCoreOutput(cid, [tokens[step] if tokens else 100 + 10 * step + i],
                                 finish_reason="length" if step == steps - 1 - i else None)
                for i, cid in enumerate(child_ids) if step <= steps - 1 - i]
        ros = processor.process_outputs(outs)
        per_step.append(ros)
        if step_tokens is not None:
            step_tokens.append(processor.take_step_tokens())
    assert not processor.has_request("r")
    return per_step


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA])
@pytest.mark.parametrize("n", [1, 3])
def test_step_tokens_count_every_step_per_user_request(kind, n):
    """The serving metrics' per-step counts: every sequence's new tokens, summed per user request,
    whatever the output kind (a FINAL_ONLY request emits no output until it finishes)."""
    counts = []
    run(kind, n, step_tokens=counts)
    assert counts == [{"r": (sum(1 for i in range(n) if step <= 4 - i), 3)} for step in range(5)]
    assert OutputProcessor(None).take_step_tokens() == {}  # not recording: nothing, at no cost


@pytest.mark.parametrize("n", [1, 3])
def test_final_only_reports_once_at_the_end_with_everything(n):
    final = run(RequestOutputKind.FINAL_ONLY, n)
    cumulative = run(RequestOutputKind.CUMULATIVE, n)
    assert all(step == [] for step in final[:-1])
    (last,) = final[-1]
    assert last.finished and last == cumulative[-1][0]
    assert [c.token_ids for c in last.outputs] == [[100 + 10 * s + i for s in range(5 - i)] for i in range(n)]


def test_final_only_with_detokenization(tok):
    ids = tok.encode(TEXTS[1], add_special_tokens=False)
    final = run(RequestOutputKind.FINAL_ONLY, 1, tok, len(ids), ids)
    cumulative = run(RequestOutputKind.CUMULATIVE, 1, tok, len(ids), ids)
    assert final[-1] == cumulative[-1] and final[-1][0].outputs[0].text == TEXTS[1]


@pytest.mark.parametrize("skip", [True, False])
def test_backend_decode_equals_the_tokenizer(tok, skip):
    fast = backend_decode(tok)
    assert fast is not None, "the embedded SmolLM2 tokenizer should take the fast path"
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        for i in range(len(ids)):
            for j in range(i, min(len(ids), i + 4) + 1):
                assert fast(ids[i:j], skip_special_tokens=skip) == tok.decode(ids[i:j], skip_special_tokens=skip)


def test_backend_decode_falls_back_when_the_wrapper_does_more(tok):
    cleaning = copy.copy(tok)
    cleaning.clean_up_tokenization_spaces = True
    assert backend_decode(cleaning) is None

    class Custom(type(tok)):
        def decode(self, *args, **kwargs):
            return "custom"

    custom = copy.copy(tok)
    custom.__class__ = Custom
    assert backend_decode(custom) is None
    assert IncrementalDetokenizer(custom, []).add_tokens([1000]) == "custom"  # the override is used
    assert backend_decode(object()) is None
