"""Stop strings and detokenization options in the OutputProcessor, with the real SmolLM2 tokenizer.

Token streams are made by tokenizing known text, then fed one token per step as the engine core
would, so matches across token boundaries and inside multi-byte characters (byte-level BPE
splits CJK characters and emoji over several tokens) are exercised deterministically.
"""

from __future__ import annotations

import pytest

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.output_processor import OutputProcessor, RequestState
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from tests.helpers import default_tokenizer


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def stream(tok, token_ids: list[int], params: SamplingParams, finish_reason: str = "length",
           stop_reason=None, kind=RequestOutputKind.DELTA, per_step: int = 1):
    """Feed ``token_ids``, ``per_step`` per step, as the scheduler does: ask the stop checker about
    each step's tokens, cut them after a stop string. Returns (outputs, whether a stop string ended it)."""
    processor = OutputProcessor(tok)
    prompt = tok.encode("Say something.", add_special_tokens=False)
    processor.add_request(RequestState("r", None, 0, "Say something.", prompt, params, tok, kind))
    outs = []
    for start in range(0, len(token_ids), per_step):
        new_ids = token_ids[start : start + per_step]
        last = start + per_step >= len(token_ids)
        reason, why = (finish_reason, stop_reason) if last else (None, None)
        hit = None
        if params.stop:
            hit = processor.check_stop_strings("r", new_ids, reason == "stop")
        if hit is not None:
            new_ids, reason, why = new_ids[: hit[0]], "stop", hit[1]
        outs.extend(processor.process_outputs([EngineCoreOutput("r", new_ids, finish_reason=reason, stop_reason=why)]))
        if hit is not None:
            return outs, True
    return outs, False


def final_text(outs) -> str:
    """The text a DELTA consumer assembles; every piece must be free of partial characters."""
    pieces = [o.outputs[0].text for o in outs]
    assert all("\ufffd" not in p for p in pieces), pieces
    return "".join(pieces)


def test_stop_string_split_across_tokens(tok):
    ids = tok.encode("Hello world, this is a test. Stop here!", add_special_tokens=False)
    assert tok.decode(ids[:1]) == "Hello" and tok.decode(ids[1:2]) == " world"
    outs, stopped = stream(tok, ids, SamplingParams(stop=["o w"]))
    assert stopped and final_text(outs) == "Hell"
    last = outs[-1].outputs[0]
    assert last.finish_reason == "stop" and last.stop_reason == "o w" and outs[-1].finished
    assert last.token_ids == [ids[1]]  # the token that completed the match is the last one kept


@pytest.mark.parametrize("per_step", [2, 3, 5])
def test_stop_string_inside_a_multi_token_step_keeps_tokens_up_to_the_match(tok, per_step):
    ids = tok.encode("Hello world, this is a test. Stop here!", add_special_tokens=False)
    outs, stopped = stream(tok, ids, SamplingParams(stop=["o w"]), per_step=per_step)
    assert stopped and final_text(outs) == "Hell"
    assert outs[-1].outputs[0].stop_reason == "o w"
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 2  # "Hello", " world": the rest dropped


def test_include_stop_str_in_output(tok):
    ids = tok.encode("Hello world, this is a test.", add_special_tokens=False)
    outs, _ = stream(tok, ids, SamplingParams(stop=["this"], include_stop_str_in_output=True))
    assert final_text(outs) == "Hello world, this"


def test_multiple_stop_strings_first_match_wins(tok):
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    outs, _ = stream(tok, ids, SamplingParams(stop=["delta", "ta gam", "zzz"]))
    assert final_text(outs) == "alpha be" and outs[-1].outputs[0].stop_reason == "ta gam"
    outs, stopped = stream(tok, ids, SamplingParams(stop=["zzz", "yyy"]))
    assert not stopped and final_text(outs) == "alpha beta gamma delta"


@pytest.mark.parametrize("text, stop, expected", [
    ("价格是100元。谢谢", "元", "价格是100"),
    ("I like 😀 a lot", "😀 a", "I like "),
    ("世界和平", "界和", "世"),
])
def test_stop_inside_multibyte_characters(tok, text, stop, expected):
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the text should split a character over tokens"
    outs, stopped = stream(tok, ids, SamplingParams(stop=[stop]))
    assert stopped and final_text(outs) == expected


def test_streaming_holds_back_a_forming_stop_string(tok):
    """No delta ever shows text that a later match trims, and cumulative outputs only grow."""
    ids = tok.encode("one two three four five six", add_special_tokens=False)
    params = SamplingParams(stop=["four five"])
    outs, _ = stream(tok, ids, params)
    assert final_text(outs) == "one two three "
    cumulative, _ = stream(tok, ids, SamplingParams(stop=["four five"]), kind=RequestOutputKind.CUMULATIVE)
    texts = [o.outputs[0].text for o in cumulative]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and texts[-1] == "one two three "


def test_stop_token_text_is_not_output(tok):
    ids = tok.encode("Hello world", add_special_tokens=False)
    stop_id = tok.encode("!", add_special_tokens=False)[0]
    outs, _ = stream(tok, ids + [stop_id], SamplingParams(stop_token_ids=[stop_id]), "stop", stop_id)
    assert final_text(outs) == "Hello world" and outs[-1].outputs[0].token_ids[-1] == stop_id
    outs, _ = stream(tok, ids + [stop_id], SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=True),
                     "stop", stop_id)
    assert final_text(outs) == "Hello world!"
    eos = tok.eos_token_id
    outs, _ = stream(tok, ids + [eos], SamplingParams(skip_special_tokens=False), "stop", None)
    assert final_text(outs) == "Hello world"  # EOS ends it and is not text, even unskipped


def test_special_tokens_options(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("Hi", add_special_tokens=False) + [im_end] + tok.encode(" there", add_special_tokens=False)
    outs, _ = stream(tok, ids, SamplingParams())
    assert final_text(outs) == "Hi there"
    outs, _ = stream(tok, ids, SamplingParams(skip_special_tokens=False))
    assert final_text(outs) == "Hi<|im_end|> there"
    outs, _ = stream(tok, ids, SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False))
    assert final_text(outs) == tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False)


def test_detokenize_false_keeps_ids_only(tok):
    ids = tok.encode("Hello world", add_special_tokens=False)
    outs, _ = stream(tok, ids, SamplingParams(detokenize=False), kind=RequestOutputKind.CUMULATIVE)
    assert outs[-1].outputs[0].text == "" and outs[-1].outputs[0].token_ids == ids


def test_min_tokens_holds_back_stop_strings(tok):
    """vLLM checks stop strings only once min_tokens tokens were generated: a stop string inside the
    first min_tokens tokens' text does not stop the sequence; the next one after them does."""
    ids = tok.encode("one, two, three, four, five, six", add_special_tokens=False)
    first_comma = next(i for i in range(len(ids)) if "," in tok.decode(ids[: i + 1]))
    outs, stopped = stream(tok, ids, SamplingParams(stop=[","]))
    assert stopped and final_text(outs) == "one"  # without min_tokens: the first comma stops it
    min_tokens = first_comma + 2  # past the first comma, before the second
    assert "," not in tok.decode(ids[first_comma + 1 : min_tokens])
    outs, stopped = stream(tok, ids, SamplingParams(stop=[","], min_tokens=min_tokens))
    text = final_text(outs)
    assert stopped and text == "one, two", text
    assert sum(len(o.outputs[0].token_ids) for o in outs) > min_tokens


@pytest.mark.parametrize("per_step", [1, 3])
def test_min_tokens_stop_string_may_start_before_and_end_after(tok, per_step):
    """A stop string that starts inside the first min_tokens tokens and ends after them counts
    (vLLM searches the text new since min_tokens, matches may begin before it)."""
    ids = tok.encode("Hello world, this is a test.", add_special_tokens=False)
    assert tok.decode(ids[:1]) == "Hello" and tok.decode(ids[1:2]) == " world"
    outs, stopped = stream(tok, ids, SamplingParams(stop=["o w"], min_tokens=1), per_step=per_step)
    assert stopped and final_text(outs) == "Hell"
    outs, stopped = stream(tok, ids, SamplingParams(stop=["o w"], min_tokens=2), per_step=per_step)
    assert not stopped and final_text(outs) == "Hello world, this is a test."
