import pytest

from pagedllm.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, this is a test.",
    "Multi-byte: 日本語のテキスト, emoji 🤖🚀 and accents: café naïve.",
    "  leading spaces\nnew lines\n\n  and\ttabs  ",
    "数字123和English混合",
]


@pytest.fixture(scope="module")
def tokenizer():
    from pagedllm.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add_tokens([t]) for t in ids]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert "\ufffd" not in "".join(pieces)


def test_partial_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🤖", add_special_tokens=False)
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = [detok.add_tokens([t]) for t in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🤖"


def test_special_tokens_skipped_or_kept(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hi there", add_special_tokens=False) + [eos]
    skip = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(skip.add_tokens([t]) for t in ids) == "Hi there"
    assert "".join(keep.add_tokens([t]) for t in ids).endswith(tokenizer.eos_token)
